"""``frugal-kernels demo``: one model, one initialisation, AdamW beside our optimizers.

Every run trains a copy of the same initial model on the same batches for the same steps
with the same learning-rate schedule; only the optimizer differs. The demo prints a table
(validation loss, optimizer state, peak memory, step time and the optimizer's share of it)
and writes ``metrics.json`` (every per-step metric) and ``demo.png`` into its output folder.

This module holds the commands (:func:`run_demo`, :func:`run_train`, and what they share with
the sweep); the rows are in :mod:`frugal_kernels.lab.registry` (adding an optimizer to the
demo is one entry in :data:`OPTIMIZERS`, whose tuned learning rates come from ``tuned.json``),
the table in :mod:`frugal_kernels.lab.report` and the figure in
:mod:`frugal_kernels.lab.plots`. Their public names are importable from here too.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from frugal_kernels.lab.corpus import TokenDataset, load_corpus
from frugal_kernels.lab.output import output_folder
from frugal_kernels.lab.peers import missing
from frugal_kernels.lab.plots import plot
from frugal_kernels.lab.registry import (DEFAULT_RUNS, DEFAULTS, OPTIMIZERS, DemoOptimizer,
                                         available, resolve, row_config, run_config,
                                         tuned_for)
from frugal_kernels.lab.report import _rows, collect_metrics, table
from frugal_kernels.lab.train import (RunResult, TrainConfig, TrainingInterrupted, check_data,
                                      equal_flops_steps, train)
from frugal_kernels.model import LlamaForCausalLM

__all__ = ["DEFAULTS", "DEFAULT_RUNS", "DemoOptimizer", "Interrupted", "OPTIMIZERS", "available",
           "collect_metrics", "plot", "resolve", "row_config", "run_config", "run_demo",
           "run_train", "table", "tuned_for", "write"]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_demo`, :func:`run_train` or a sweep, after what was finished
    has been written: ``message`` says what was kept and where (one line)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def overall_progress(k: int, total: int, label: str, elapsed: float, done_seconds: float,
                     steps_done: int, steps_left: int) -> str:
    """The line before run ``k`` of ``total``: the time so far and an estimate of the rest
    from the seconds per step of the runs finished (``done_seconds`` over ``steps_done``)."""
    rest = (f", about {_duration(done_seconds / steps_done * steps_left)} left"
            if steps_done else "")
    return f"run {k} of {total}: {label} ({_duration(elapsed)} elapsed{rest})"


def run_folder(out, command: str, overwrite: bool, progress, **options) -> Path:
    """The run's output folder, made and checked before any training
    (:func:`output_folder`); its note (a new folder beside earlier results) on stderr."""
    out, note = output_folder(out, command, overwrite, **options)
    if note and progress:
        print(note, file=sys.stderr)
    return out


def checked_data(config: TrainConfig, data: Optional[TokenDataset] = None) -> TokenDataset:
    """``data`` (the config's corpus when None), refused before any training when it is too
    small for the config's batches."""
    if data is None:
        data = load_corpus(config.data, max_bytes=config.max_bytes)
    check_data(data, config)
    return data


def run_demo(config: TrainConfig = DEFAULTS, names: Sequence[str] = DEFAULT_RUNS,
             out: Optional[Path] = None, progress: bool | str = True,
             tuned: bool = True, data: Optional[TokenDataset] = None,
             overwrite: bool = False, select_at_equal_steps: bool = False) -> dict[str, Any]:
    """Train one copy of the same initial model per optimizer in ``names`` (those whose
    package is installed) on ``data`` (default ``load_corpus(config.data)``); write
    ``metrics.json``, ``table.md``, ``table.csv`` and ``demo.png`` into ``out`` (default
    ``runs/demo-<time>``; see :func:`~frugal_kernels.lab.output.output_folder` for a folder
    that holds earlier results and ``overwrite``) after every run, so that what finished is
    kept if the demo is stopped. With ``tuned``, each optimizer runs at its recorded
    learning rates (:func:`run_config`), else all at ``config.lr`` and
    ``config.matrix_lr_ratio``. A line before each run says which of how many it is, the
    time so far and an estimate of the rest (unless ``progress`` is False). A row that
    selects its data gets the FLOPs its twin spent, scoring counted
    (:func:`~frugal_kernels.lab.train.equal_flops_steps` sets its steps); with
    ``select_at_equal_steps``, the twin's steps instead.

    Returns the metrics (what ``metrics.json`` holds) with ``"out"`` and ``"files"`` added.
    Ctrl-C writes the finished runs and raises :class:`Interrupted`.
    """
    names = available(resolve(names))
    out = run_folder(out, "demo", overwrite, progress)
    data = checked_data(config, data)
    initial = LlamaForCausalLM(config.model_config(data.vocab_size), seed=config.seed)
    started = time.perf_counter()
    results: dict[str, RunResult] = {}
    spreads = {name: tuned_for(config, name) for name in names} if tuned else {}
    metrics: dict[str, Any] = {}
    files: list[str] = []
    for k, name in enumerate(names, 1):
        entry = OPTIMIZERS[name]
        # --select sets the policy of the +select rows; the others train on plain batches.
        named_config = row_config(run_config(config, name, tuned), name)
        if not entry.selects and named_config.select is not None:
            named_config = dataclasses.replace(named_config, select=None)
        if entry.budget_from is not None:
            named_config = dataclasses.replace(named_config,
                                               flop_budget=results[entry.budget_from].flops,
                                               governor=dict(entry.governor))
        if entry.twin is not None and not select_at_equal_steps:
            twin = results[entry.twin]
            named_config = named_config.with_steps(equal_flops_steps(
                named_config, twin.flops, twin.steps_done, data.vocab_size))
        if progress:
            done = [r for r in results.values()]
            print(overall_progress(k, len(names), entry.label, time.perf_counter() - started,
                                   sum(r.wall_time for r in done),
                                   sum(r.steps_done for r in done),
                                   (len(names) - k + 1) * config.steps),
                  file=sys.stderr, flush=True)
        try:
            results[name] = train(named_config, entry.make, model=copy.deepcopy(initial),
                                  data=data, name=entry.label, progress=progress)
        except KeyboardInterrupt:
            kept = (f"wrote the {len(results)} finished runs to {out}" if results
                    else "no run had finished, nothing written")
            raise Interrupted(f"interrupted during run {k} of {len(names)} ({entry.label}); "
                              f"{kept}") from None
        metrics = collect_metrics(config, data, results, time.perf_counter() - started,
                                  spreads, planned=names)
        files = write(metrics, out, "demo")
    return {**metrics, "out": str(out), "files": files}


def run_train(config: TrainConfig, name: str = "adafrugal", *,
              data: Optional[TokenDataset] = None, out: Optional[Path] = None,
              progress: bool | str = True, save_model: bool = False,
              overwrite: bool = False, resume: Optional[dict[str, Any]] = None,
              log: Optional[str] = None, model: Optional[nn.Module] = None,
              rows: Optional[Mapping[str, DemoOptimizer]] = None,
              task: str = "pretrain") -> dict[str, Any]:
    """``frugal-kernels train``: train ``model`` (default a fresh one) with the optimizer
    ``name`` of ``rows`` (default :data:`OPTIMIZERS`; ``task`` is recorded in the metrics
    and the checkpoint, ``"finetune"`` for a base of :mod:`~frugal_kernels.lab.finetune`), under the compute governor when ``config.flop_budget`` is set, on
    ``data`` (default ``load_corpus(config.data)``); write ``metrics.json``, ``train.png``,
    the training checkpoint ``checkpoint.pt`` (at every evaluation: what ``resume`` takes,
    see :func:`~frugal_kernels.lab.train.load_checkpoint`) and, with ``save_model``, the
    trained weights ``model.pt`` into ``out`` (default ``runs/train-<time>``; a folder with
    earlier results only with ``overwrite``, or the checkpoint's own folder when resuming).
    ``log`` sends the scalars to ``"tensorboard"`` (``out/tensorboard``) or ``"wandb"``. A
    parallel run (``config.parallel``, every rank calling this) writes from its first rank,
    without checkpoints.

    Returns the metrics (what ``metrics.json`` holds) with ``"out"`` and ``"files"`` added.
    Ctrl-C writes the metrics of the steps done and raises :class:`Interrupted`.
    """
    entry = (OPTIMIZERS if rows is None else rows)[name]
    if name in OPTIMIZERS:
        config = row_config(config, name)
    if entry.budget_from is not None:
        raise ValueError(f"{name!r} takes its budget from the {entry.budget_from!r} run; "
                         "train that one, with config.flop_budget for a governed run")
    reason = missing(entry.requires)
    if reason is not None:
        raise ValueError(f"{name!r} cannot run here: {reason}")
    # A parallel run (config.parallel) writes from its first rank only.
    first = config.parallel is None or torch.distributed.get_rank() == 0
    if first:
        # Resuming keeps the checkpoint it resumes from until the next one replaces it.
        out = run_folder(out, "train", overwrite, progress,
                         keep=("checkpoint.pt",) if resume is not None else ())
    data = checked_data(config, data)
    logger = None
    if log is not None and first:
        from frugal_kernels.lab.train import metric_logger

        logger = metric_logger(log, Path(out) / log, config, entry.label)
    if model is None:
        model = LlamaForCausalLM(config.model_config(data.vocab_size), seed=config.seed)
    checkpoint, saved_at = None, []
    if config.parallel is None:
        def checkpoint(state: dict[str, Any]) -> None:
            # Written beside and renamed over the last one: a kill while writing keeps it.
            partial = Path(out) / "checkpoint.pt.partial"
            torch.save({**state, "optimizer_name": name, "task": task}, partial)
            partial.replace(Path(out) / "checkpoint.pt")
            saved_at.append(state["step"])
    started = time.perf_counter()
    try:
        result = train(config, entry.make, model=model, data=data, name=entry.label,
                       progress=progress, checkpoint=checkpoint, resume=resume, log=logger)
        interrupted = None
    except TrainingInterrupted as stop:
        result, interrupted = stop.result, stop
    finally:
        if logger is not None:
            logger.close()
    if interrupted is not None:
        if not result.evaluations:
            raise Interrupted(f"{result.stop_reason}, before its first evaluation; nothing "
                              "written")
        metrics = collect_metrics(config, data, {name: result}, result.wall_time, rows=rows)
        metrics["task"] = task
        if first:
            write(metrics, Path(out), "train")
        saved_at += [] if saved_at or resume is None else [int(resume["step"])]
        at = (f"; resume from step {saved_at[-1]} with --resume {Path(out) / 'checkpoint.pt'}"
              if saved_at else "")
        raise Interrupted(f"{result.stop_reason}; wrote the metrics so far to {out}{at}")
    metrics = collect_metrics(config, data, {name: result}, time.perf_counter() - started,
                              rows=rows)
    metrics["task"] = task
    files = write(metrics, Path(out), "train") if first else []
    if first and checkpoint is not None:
        files.append(str(Path(out) / "checkpoint.pt"))
    if save_model:
        state = model.state_dict()
        if config.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 get_model_state_dict)

            # The whole weights, gathered on the first rank (every rank takes part).
            state = get_model_state_dict(model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        if first:
            torch.save(state, Path(out) / "model.pt")
            files.append(str(Path(out) / "model.pt"))
    return {**metrics, "out": str(out), "files": files}


def write(metrics: dict[str, Any], out: Path, plot_name: str) -> list[str]:
    """Write ``out/metrics.json``, the table as ``out/table.md`` and ``out/table.csv``, and
    ``out/<plot_name>.png``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "metrics.json", out / "table.md", out / "table.csv"]
    files[0].write_text(json.dumps(metrics, indent=1))
    files[1].write_text(table(metrics) + "\n")
    header, rows = _rows(metrics)
    with open(files[2], "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    png = plot(metrics, out / f"{plot_name}.png")
    if png is not None:
        files.append(png)
    return [str(f) for f in files]
