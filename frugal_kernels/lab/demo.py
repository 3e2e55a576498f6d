"""``frugal-kernels demo``: one model, one initialisation, AdamW beside our optimizers.

Every run trains a copy of the same initial model on the same batches for the same steps
with the same learning-rate schedule; only the optimizer differs. The demo prints a table
(validation loss, optimizer state, peak memory, step time and the optimizer's share of it)
and writes ``metrics.json`` (every per-step metric) and ``demo.png`` into its output folder.

Adding an optimizer to the demo is one entry in :data:`OPTIMIZERS`. Each optimizer runs at
the learning rates recorded for it and the model preset in ``tuned.json``
(:mod:`frugal_kernels.lab.tuned`, from ``frugal-kernels sweep``) unless ``tuned=False``.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from frugal_kernels.lab import tuned as tuned_lrs
from frugal_kernels.lab.corpus import TokenDataset, load_corpus
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM
from frugal_kernels.nn import quantize_
from frugal_kernels.optim import DQT, FRUGAL, AdaFRUGAL, BAdam, step_in_backward
from frugal_kernels.lab.output import output_folder
from frugal_kernels.lab.peers import PEERS, missing
from frugal_kernels.lab.train import (OptimizerFactory, RunResult, TrainConfig,
                                      TrainingInterrupted, check_data, lr_groups, train)

__all__ = ["DEFAULTS", "DEFAULT_RUNS", "DemoOptimizer", "Interrupted", "OPTIMIZERS", "available",
           "collect_metrics", "plot", "resolve", "run_config", "run_demo", "run_train", "table",
           "write"]


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

# The paper's T = 200 is for runs of tens of thousands of steps. On short runs each subspace
# change costs (the new state-full blocks restart their moments: at 300 x 16, T = 10 / 50 / 200
# gave 1.907 / 1.878 / 1.832, docs/demo.md), so the demo's 200 steps get one change, at T = 100.
UPDATE_GAP = 100

# BAdam's blocks on the demo model ("small": 4 layers) are the embedding, the layers and the
# head: 6 blocks. Switching every 20 steps gives the 200 steps 10 switches, so every block
# trains at least once; the published default (K = 100 on runs of thousands of steps) would
# leave four of the six blocks untrained.
BADAM_SWITCH_EVERY = 20


@dataclass(frozen=True)
class DemoOptimizer:
    """One run of the demo: how its optimizer is built and how it is drawn.

    ``make(model, config)`` returns the optimizer (``config.steps`` is the run length, for
    schedules such as AdaFRUGAL's rho). A run with ``budget_from`` is governed: its FLOP
    budget is what the run named there spent, and ``governor`` holds the keyword arguments of
    its :class:`~frugal_kernels.Governor`. ``requires`` names the (module, pip distribution)
    an optional row needs; without it the row is skipped with a notice. ``tuned_as`` names
    the row whose tuned lrs this one takes (a governed run takes its budget source's), for a
    row that runs the same optimizer another way. ``describe(run)``, where given, is the
    label of a finished run (its record in metrics.json), for a label that says what the
    run did (the rho AdaFRUGAL reached); ``note`` (a string, or a function of the run) says
    why the row may end far from AdamW, printed under the table when it does.
    """

    label: str
    color: str
    make: OptimizerFactory
    budget_from: Optional[str] = None
    governor: dict[str, Any] = field(default_factory=dict)
    requires: Optional[tuple[str, str]] = None
    tuned_as: Optional[str] = None
    describe: Optional[Callable[[dict[str, Any]], str]] = None
    note: Union[str, Callable[[dict[str, Any]], str]] = ""


def _adamw(model, config: TrainConfig) -> torch.optim.Optimizer:
    # torch's fused AdamW exists for CPU and CUDA tensors; elsewhere (None) torch picks.
    fused = True if torch.device(config.device).type in ("cpu", "cuda") else None
    return torch.optim.AdamW(lr_groups(model, config), lr=config.lr,
                             weight_decay=config.weight_decay, fused=fused)


def _frugal(model, config: TrainConfig) -> FRUGAL:
    return FRUGAL(lr_groups(model, config), lr=config.lr, weight_decay=config.weight_decay,
                  density=0.25, update_gap=UPDATE_GAP, projection="blocks")


def _frugal_in_backward(model, config: TrainConfig) -> FRUGAL:
    """The frugal row's optimizer stepping each tensor inside backward. Its gradients are
    clipped by the global norm as the other rows' (config.grad_clip), which takes a first
    backward pass for the norm (StepInBackward.norm_pass, run by train); nonfinite="raise"
    as "skip" needs every gradient first (the gradients here are finite)."""
    opt = FRUGAL(lr_groups(model, config), lr=config.lr, weight_decay=config.weight_decay,
                 density=0.25, update_gap=UPDATE_GAP, projection="blocks", nonfinite="raise")
    step_in_backward(opt, max_grad_norm=config.grad_clip, clip="global")
    return opt


def _adafrugal(model, config: TrainConfig) -> AdaFRUGAL:
    return AdaFRUGAL(lr_groups(model, config), lr=config.lr, weight_decay=config.weight_decay,
                     rho_start=0.25, rho_end=0.05, rho_steps=config.steps,
                     update_gap=UPDATE_GAP, update_gap_max=4 * UPDATE_GAP, projection="blocks")


def _badam(model, config: TrainConfig) -> BAdam:
    return BAdam(model, lr=config.lr, weight_decay=config.weight_decay,
                 switch_every=BADAM_SWITCH_EVERY, include_embedding=True, include_head=True,
                 seed=config.seed)


def _badam_frugal(model, config: TrainConfig) -> BAdam:
    return BAdam(model, lr=config.lr, weight_decay=config.weight_decay,
                 switch_every=BADAM_SWITCH_EVERY, include_embedding=True, include_head=True,
                 seed=config.seed, inner="frugal", density=0.25, projection="columns")


def _dqt(bits: int, update: str, in_backward: bool = False) -> OptimizerFactory:
    """DQT at ``bits`` over the model's attention and MLP matrices (quantized in place,
    per-row scales set by absmax, bf16 weight gradients: 2 bytes per weight instead of 4);
    the embeddings, norms and head stay fp32 with AdamW. DQT's own absmean scale clips
    about 40% of the initial weights and costs 8% in loss at 4 bits here (docs/demo.md).
    ``in_backward``: each tensor stepped inside backward, as the frugal+inbwd row."""
    def make(model, config: TrainConfig) -> DQT:
        quantize_(model, bits=bits, scale="row", dtype=torch.bfloat16, scale_init="absmax")
        opt = DQT(lr_groups(model, config), lr=config.lr, weight_decay=config.weight_decay,
                  update=update, density=0.25, projection="columns", update_gap=UPDATE_GAP,
                  seed=config.seed, nonfinite="raise" if in_backward else "skip")
        if in_backward:
            step_in_backward(opt, max_grad_norm=config.grad_clip, clip="global")
        return opt
    return make


def _dqt_rows() -> dict[str, DemoOptimizer]:
    """dqt8 .. dqt2 (ternary), alone and with FRUGAL, and 4-bit + FRUGAL stepped in
    backward. Not swept: they take AdamW's lrs."""
    # Colours of their own (the tab: palette is taken by the other rows and the peers), so
    # that any selection of rows stays readable in the plot.
    colors = {8: ("teal", "turquoise"), 4: ("indigo", "black"),
              3: ("saddlebrown", "sandybrown"), 2: ("crimson", "lightcoral")}
    rows = {}
    for bits in (8, 4, 3, 2):
        width = "ternary" if bits == 2 else f"{bits}-bit"
        alone, with_frugal = colors[bits]
        rows[f"dqt{bits}"] = DemoOptimizer(f"DQT {width}", alone, _dqt(bits, "adamw"),
                                           tuned_as="adamw",
                                           note=_DQT_NOTE.format(bits=width))
        rows[f"dqt{bits}-frugal"] = DemoOptimizer(f"DQT {width} + FRUGAL rho=0.25",
                                                  with_frugal, _dqt(bits, "frugal"),
                                                  tuned_as="adamw",
                                                  note=_DQT_FRUGAL_NOTE.format(bits=width))
    rows["dqt4-frugal+inbwd"] = DemoOptimizer("DQT 4-bit + FRUGAL rho=0.25, step in backward",
                                              "darkviolet", _dqt(4, "frugal", in_backward=True),
                                              tuned_as="adamw",
                                              note=_DQT_FRUGAL_NOTE.format(bits="4-bit"))
    return rows


def _rho_reached(prefix: str) -> Callable[[dict[str, Any]], str]:
    """A label with the rho the run started at and the lowest it reached: AdaFRUGAL's rho
    follows its schedule only when the subspace changes (every T steps), so a short run ends
    above the schedule's rho_end (0.15 after 200 steps at T = 100, not 0.05)."""
    def describe(run: dict[str, Any]) -> str:
        rhos = [s["rho"] for s in run["steps"] if "rho" in s]
        if not rhos:
            return prefix
        if min(rhos) == rhos[0]:  # the run ended before the first subspace change
            return f"{prefix} rho {rhos[0]:.3g} (not lowered)"
        return f"{prefix} rho {rhos[0]:.3g}->{min(rhos):.3g}"
    return describe


def _adafrugal_note(run: dict[str, Any]) -> str:
    rhos = [s["rho"] for s in run["steps"] if "rho" in s]
    reached = min(rhos) if rhos else 0.25
    return (f"AdaFRUGAL's rho is scheduled from 0.25 to 0.05 over the run, but it changes only "
            f"when the subspace does (every T = {UPDATE_GAP} steps, T growing when the loss "
            f"stalls), so it reached {reached:.3g}"
            + (": less state than FRUGAL's 0.25 for the last subspaces" if reached < 0.25
               else ", the same state as FRUGAL's"))


def _badam_note(run: dict[str, Any]) -> str:
    layers = LlamaConfig.from_preset(run["config"]["model"]).num_layers
    blocks = layers + 2  # the embedding, every layer, the head
    return (f"BAdam is a fine-tuning method: it trains one block of {blocks} at a time (the "
            f"embedding, each of the {layers} layers, the head; K = {BADAM_SWITCH_EVERY} "
            f"steps each), so in pretraining from scratch each weight trains for about "
            f"1/{blocks} of the steps; its place is fine-tuning a trained model")


_DQT_NOTE = ("DQT keeps the matrices only as {bits} codes: every update is rounded "
             "(stochastically) to that grid, which loses the updates smaller than a grid step")
_DQT_FRUGAL_NOTE = (_DQT_NOTE + "; with FRUGAL, the state-free columns move by SignSGD steps of "
                    "lr each, which a coarse grid rounds away more often")


OPTIMIZERS: dict[str, DemoOptimizer] = {
    "adamw": DemoOptimizer("AdamW", "tab:gray", _adamw),
    "frugal": DemoOptimizer("FRUGAL rho=0.25", "tab:blue", _frugal,
                            note="FRUGAL keeps AdamW's moments for a quarter of the matrices "
                                 "(whole tensors, changed every T steps) and moves the rest "
                                 "by SignSGD"),
    # The same optimizer, each tensor stepped in backward: the frugal row's loss with one
    # gradient alive at a time; it takes the frugal row's tuning.
    "frugal+inbwd": DemoOptimizer("FRUGAL rho=0.25, step in backward", "deepskyblue",
                                  _frugal_in_backward, tuned_as="frugal",
                                  note="the FRUGAL row's optimizer stepped inside backward: it "
                                       "differs from that row only by rounding (the clip's "
                                       "norm is summed in another order)"),
    "adafrugal": DemoOptimizer("AdaFRUGAL", "tab:orange", _adafrugal,
                               describe=_rho_reached("AdaFRUGAL"), note=_adafrugal_note),
    "adafrugal+governor": DemoOptimizer("AdaFRUGAL+governor", "tab:red", _adafrugal,
                                        budget_from="adafrugal",
                                        describe=_rho_reached("AdaFRUGAL+governor")),
    "badam": DemoOptimizer(f"BAdam K={BADAM_SWITCH_EVERY}", "tab:green", _badam,
                           note=_badam_note),
    # Not swept: it takes BAdam's tuned lr.
    "badam+frugal": DemoOptimizer(f"BAdam+FRUGAL K={BADAM_SWITCH_EVERY} rho=0.25", "limegreen",
                                  _badam_frugal, tuned_as="badam",
                                  note=lambda run: _badam_note(run) + "; FRUGAL runs inside "
                                                   "the active block"),
    **_dqt_rows(),
}


def _peer(spec: dict[str, Any]) -> DemoOptimizer:
    """A row of :data:`~frugal_kernels.lab.peers.PEERS`; a subspace method gets the demo's T."""
    spec = dict(spec)
    make = spec.pop("make")
    if not spec.pop("subspace", False):
        return DemoOptimizer(make=make, **spec)

    def make_at_the_demos_gap(model, config: TrainConfig) -> torch.optim.Optimizer:
        return make(model, config, update_gap=UPDATE_GAP)  # read when built, as FRUGAL's

    return DemoOptimizer(make=make_at_the_demos_gap, **spec)


# What users would pick instead (frugal_kernels.lab.peers): rows skipped when their package is not
# installed.
OPTIMIZERS.update((name, _peer(spec)) for name, spec in PEERS.items())

# The runs of a plain `frugal-kernels demo`: every row but the DQT widths other than 4 bits
# and DQT in backward, which `--optimizers dqt8 dqt3 dqt2 dqt4-frugal+inbwd ...` adds (each
# run costs about a minute on a 2-core CPU).
DEFAULT_RUNS = tuple(name for name in OPTIMIZERS
                     if not name.startswith("dqt") or name in ("dqt4", "dqt4-frugal"))

# TrainConfig's defaults are the demo's (docs/demo.md); each optimizer's two learning rates
# come from tuned.json, where a sweep recorded them for the model preset.
DEFAULTS = TrainConfig()


def resolve(names: Sequence[str]) -> list[str]:
    """``names`` in order, each governed run preceded by the run its budget comes from."""
    ordered: list[str] = []
    for name in names:
        if name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
        source = OPTIMIZERS[name].budget_from
        if source is not None and source not in ordered:
            ordered.append(source)
        if name not in ordered:
            ordered.append(name)
    return ordered


def available(names: Sequence[str]) -> list[str]:
    """``names`` without the rows whose package is missing, each skipped with a one-line
    notice on stderr."""
    kept = []
    for name in names:
        reason = missing(OPTIMIZERS[name].requires)
        if reason is None:
            kept.append(name)
        else:
            print(f"skipping {name}: {reason}", file=sys.stderr)
    return kept


def tuned_for(config: TrainConfig, name: str) -> Optional[dict[str, Any]]:
    """What ``tuned.json`` records for the run ``name`` on ``config.model`` (or for its
    ``tuned_as``, else the run its budget comes from); None if nothing is recorded."""
    entry = OPTIMIZERS[name]
    return tuned_lrs.lookup(config.model, entry.tuned_as or entry.budget_from or name)


def run_config(config: TrainConfig, name: str, tuned: bool = True) -> TrainConfig:
    """``config`` for the run ``name``: with ``tuned``, its lr and matrix lr ratio are the
    recorded best for ``config.model`` where one is recorded."""
    best = tuned_for(config, name) if tuned else None
    if best is None:
        return config
    return dataclasses.replace(config, lr=best["lr"], matrix_lr_ratio=best["matrix_lr_ratio"])


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
             overwrite: bool = False) -> dict[str, Any]:
    """Train one copy of the same initial model per optimizer in ``names`` (those whose
    package is installed) on ``data`` (default ``load_corpus(config.data)``); write
    ``metrics.json``, ``table.md``, ``table.csv`` and ``demo.png`` into ``out`` (default
    ``runs/demo-<time>``; see :func:`~frugal_kernels.lab.output.output_folder` for a folder
    that holds earlier results and ``overwrite``) after every run, so that what finished is
    kept if the demo is stopped. With ``tuned``, each optimizer runs at its recorded
    learning rates (:func:`run_config`), else all at ``config.lr`` and
    ``config.matrix_lr_ratio``. A line before each run says which of how many it is, the
    time so far and an estimate of the rest (unless ``progress`` is False).

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
        named_config = run_config(config, name, tuned)
        if entry.budget_from is not None:
            named_config = dataclasses.replace(named_config,
                                               flop_budget=results[entry.budget_from].flops,
                                               governor=dict(entry.governor))
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
              log: Optional[str] = None) -> dict[str, Any]:
    """``frugal-kernels train``: train a fresh model with the optimizer ``name`` of
    :data:`OPTIMIZERS`, under the compute governor when ``config.flop_budget`` is set, on
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
    entry = OPTIMIZERS[name]
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
    model = LlamaForCausalLM(config.model_config(data.vocab_size), seed=config.seed)
    checkpoint, saved_at = None, []
    if config.parallel is None:
        def checkpoint(state: dict[str, Any]) -> None:
            # Written beside and renamed over the last one: a kill while writing keeps it.
            partial = Path(out) / "checkpoint.pt.partial"
            torch.save({**state, "optimizer_name": name}, partial)
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
        metrics = collect_metrics(config, data, {name: result}, result.wall_time)
        if first:
            write(metrics, Path(out), "train")
        saved_at += [] if saved_at or resume is None else [int(resume["step"])]
        at = (f"; resume from step {saved_at[-1]} with --resume {Path(out) / 'checkpoint.pt'}"
              if saved_at else "")
        raise Interrupted(f"{result.stop_reason}; wrote the metrics so far to {out}{at}")
    metrics = collect_metrics(config, data, {name: result}, time.perf_counter() - started)
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


def collect_metrics(config: TrainConfig, data: TokenDataset, results: dict[str, RunResult],
                    wall_time: float,
                    tuned: Optional[dict[str, Optional[dict[str, Any]]]] = None,
                    planned: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """What ``metrics.json`` holds: the machine, the data, the settings and every run;
    ``tuned`` (per run) the tuned.json record its learning rates came from; ``planned`` the
    runs the demo was to train, of which ``results`` are those finished so far."""
    from frugal_kernels.bench.fingerprint import fingerprint

    tuned = tuned or {}
    runs = {}
    for name, result in results.items():
        entry = OPTIMIZERS[name]
        run = {"label": entry.label, "color": entry.color,
               "budget_from": entry.budget_from, "tuned": tuned.get(name),
               **result.to_dict()}
        run["label"] = entry.describe(run) if entry.describe else entry.label
        run["note"] = entry.note(run) if callable(entry.note) else entry.note
        runs[name] = run
    return {
        "command": " ".join(sys.argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "wall_time": wall_time,
        "fingerprint": fingerprint(torch.device(config.device)),
        "data": {"source": data.source, "digest": data.digest,
                 "train_tokens": len(data.train), "validation_tokens": len(data.validation)},
        "config": dataclasses.asdict(config),
        "planned": list(planned if planned is not None else results),
        "runs": runs,
    }


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


_PEAK_MEANING = {
    "rss_peak": "the process's resident-memory high-water mark during the run (torch, model "
                "and data included)",
    "rss_peak_since_process_start": "the process's resident-memory high-water mark since it "
                                    "started",
    "cuda_max_allocated": "torch.cuda.max_memory_allocated during the run",
}


def _mb(num_bytes: float) -> float:
    return num_bytes / 2**20


def _rows(metrics: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows, as the text of their cells."""
    runs = metrics["runs"]
    first = next(iter(runs.values()))
    compare = len(runs) > 1
    header = ["optimizer", "steps", "val loss", *([f"vs {first['label']}"] if compare else []),
              "lr (matrices)", "held MB", "state MB", "peak MB", "ms/step", "optimizer share",
              "FLOPs"]
    rows = []
    for run in runs.values():
        s = run["summary"]
        change = s["final_val_loss"] / first["summary"]["final_val_loss"] - 1
        lr = run["config"]["lr"]
        rows.append([
            run["label"], str(s["steps"]), f"{s['final_val_loss']:.4f}",
            *([f"{change:+.2%}"] if compare else []),
            f"{lr:.3g} ({lr * run['config']['matrix_lr_ratio']:.3g})",
            f"{_mb(s['held_bytes']):.2f}", f"{_mb(s['max_state_bytes']):.2f}",
            f"{_mb(s['peak_memory']):.0f}",
            f"{s['step_time'] * 1e3:.0f}", f"{s['optimizer_share']:.1%}", f"{s['flops']:.3g}",
        ])
    return header, rows


def table(metrics: dict[str, Any]) -> str:
    """The runs side by side, as a markdown table, then the verdict against the first run
    (AdamW in the default demo), a recommendation per memory budget, why the rows far from
    the first run are there, and a note on each governed run."""
    runs = metrics["runs"]
    first = next(iter(runs.values()))
    header, rows = _rows(metrics)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    planned = metrics.get("planned", list(runs))
    if len(runs) < len(planned):
        left = [OPTIMIZERS[n].label if n in OPTIMIZERS else n for n in planned if n not in runs]
        lines.append(f"\n{len(runs)} of {len(planned)} runs finished; not run: "
                     f"{', '.join(left)}.")
    kind = first["summary"]["peak_memory_kind"]
    lines.append(f"\nheld MB: the weights, gradients and optimizer state held during a step "
                 f"(the most over the run, each storage counted once); state MB: the most "
                 f"optimizer state held at once over the run; peak MB: "
                 f"{_PEAK_MEANING.get(kind, kind)}; ms/step and optimizer share: from the "
                 f"median step and optimizer-step times; lr: of the embeddings, norms and "
                 f"head (of the matrices).")
    for part in (_verdict(metrics), _recommendations(metrics), _explanations(metrics)):
        if part:
            lines.append("\n" + part)
    for run in runs.values():
        source = run["budget_from"]
        if source is None or source not in runs:
            continue
        s, full = run["summary"], runs[source]["summary"]
        lines.append(
            f"\n{run['label']}: {s['stop_reason']}. It spent {s['flops'] / s['flop_budget']:.1%} "
            f"of its budget (the FLOPs of the full {runs[source]['label']} run), for a "
            f"validation loss {s['final_val_loss'] / full['final_val_loss'] - 1:+.2%} against it.")
    return "\n".join(lines)


def _spread(run: dict[str, Any]) -> Optional[float]:
    """The seed-to-seed range of the sweep behind the run's tuned lrs; None when unknown
    (not tuned, or a sweep of one seed, whose range of 0 says nothing)."""
    tuned = run.get("tuned")
    if tuned is None or tuned.get("seeds", 2) < 2:
        return None
    return tuned["spread"]


def _compared(metrics: dict[str, Any]) -> list[tuple[dict[str, Any], float, Optional[float]]]:
    """(run, loss difference to the first run, the spread that decides it; None when not
    known) for every finished run after the first but the governed ones."""
    runs = list(metrics["runs"].values())
    first = runs[0]
    base = first["summary"]["final_val_loss"]
    compared = []
    for run in runs[1:]:
        if run["budget_from"] is not None:
            continue
        spreads = (_spread(run), _spread(first))
        spread = None if None in spreads else max(spreads)
        compared.append((run, run["summary"]["final_val_loss"] - base, spread))
    return compared


def _verdict(metrics: dict[str, Any]) -> str:
    """Which runs end better than the first, which worse, and which the same within the
    seed-to-seed spread the sweep behind tuned.json measured (its seeds' range at each one's
    best setting; of two runs, the larger spread counts). Runs without a spread (lrs not
    tuned, a one-seed sweep) are put as lower or higher, with that caveat."""
    runs = list(metrics["runs"].values())
    first = runs[0]
    compared = _compared(metrics)
    if not compared:
        return ""
    base = first["summary"]["final_val_loss"]
    better, worse, same, lower, higher = [], [], [], [], []
    for run, difference, spread in compared:
        if spread is None:
            (lower if difference < 0 else higher).append(f"{run['label']} ({difference / base:+.2%})")
            continue
        text = f"{run['label']} ({difference / base:+.2%}, spread {spread / base:.2%})"
        if abs(difference) <= spread:
            same.append(text)
        else:
            (better if difference < 0 else worse).append(text)
    parts = []
    if better or worse or same:
        seeds = len((first.get("tuned") or {}).get("settings", {}).get("seeds", [])) or "its"
        parts.append(
            f"Against {first['label']}, beyond the seed-to-seed spread (the range over {seeds} "
            f"seeds in the sweep behind tuned.json): better: {', '.join(better) or 'none'}; "
            f"worse: {', '.join(worse) or 'none'}. The same within the seed-to-seed spread: "
            f"{', '.join(same) or 'none'}.")
        settings = first["tuned"]["settings"] if first.get("tuned") else None
        if settings and not tuned_lrs.comparable(settings["config"], metrics["config"]):
            parts.append("(This run's settings differ from the sweep's, so the spread is only "
                         "a guide.)")
    if lower or higher:
        parts.append(
            f"Against {first['label']}, with no seed-to-seed spread to tell a difference from "
            f"noise (lrs not from a sweep of two seeds or more): lower loss: "
            f"{', '.join(lower) or 'none'}; higher: {', '.join(higher) or 'none'}.")
    return " ".join(parts)


# Memory budgets of the recommendations, as fractions of the first run's held bytes.
BUDGETS = (1.0, 2 / 3, 1 / 2, 1 / 3)


def _recommendations(metrics: dict[str, Any]) -> str:
    """One line per memory budget (a fraction of what the first run holds in a step): the
    run to pick there and why. Among the finished runs that fit, the lowest final loss wins;
    a faster run (median step time) within the seed-to-seed spread of it wins instead, since
    this run does not tell their losses apart and both fit. A budget whose pick is the
    larger budget's is left out (the pick already fits)."""
    runs = [run for run in metrics["runs"].values() if run["budget_from"] is None]
    if len(runs) < 2:
        return ""
    first = runs[0]
    base_held = first["summary"]["held_bytes"]
    base_loss = first["summary"]["final_val_loss"]
    lines, previous = [], None
    for fraction in BUDGETS:
        budget = fraction * base_held
        fits = [r for r in runs if r["summary"]["held_bytes"] <= budget * (1 + 1e-9)]
        if not fits:
            continue
        best = min(fits, key=lambda r: r["summary"]["final_val_loss"])
        best_loss = best["summary"]["final_val_loss"]

        def ties(run):
            spreads = (_spread(run), _spread(best))
            if None in spreads:
                return run is best
            return run["summary"]["final_val_loss"] - best_loss <= max(spreads)

        pick = min((r for r in fits if ties(r)),
                   key=lambda r: (r["summary"].get("step_time", 0.0), r["summary"]["held_bytes"]))
        if pick is previous:
            continue
        previous = pick
        s = pick["summary"]
        where = (f"{first['label']}'s {_mb(base_held):.1f} MB" if fraction == 1.0
                 else f"{fraction:.0%} of {first['label']}'s")
        speed = f", {s['step_time'] * 1e3:.0f} ms/step" if "step_time" in s else ""
        if pick is best:
            reason = (f"the lowest loss of the {len(fits)} runs that fit "
                      f"({s['final_val_loss']:.4f}, {s['final_val_loss'] / base_loss - 1:+.2%} "
                      f"against {first['label']}), holding {_mb(s['held_bytes']):.1f} MB{speed}")
        else:
            reason = (f"within the seed-to-seed spread of the lowest loss ({best['label']}, "
                      f"{best_loss:.4f}) and faster, {s['step_time'] * 1e3:.0f} ms/step against "
                      f"{best['summary']['step_time'] * 1e3:.0f}, holding "
                      f"{_mb(s['held_bytes']):.1f} MB")
        lines.append(f"- at most {_mb(budget):.1f} MB held ({where}): {pick['label']}: "
                     f"{reason}.")
    if not lines:
        return ""
    return "Recommendation per memory budget (held MB):\n" + "\n".join(lines)


# Rows that end this far from the first run get their explanation even without a spread.
FAR = 0.05


def _explanations(metrics: dict[str, Any]) -> str:
    """Why the rows far behind the first run (worse beyond the spread, or by FAR without
    one) are there: each optimizer's note. Rows ahead need no excuse; the recommendations
    name them."""
    first = next(iter(metrics["runs"].values()))
    base = first["summary"]["final_val_loss"]
    lines = []
    for run, difference, spread in _compared(metrics):
        if difference > (spread if spread is not None else FAR * base) and run.get("note"):
            lines.append(f"- {run['label']} ({difference / base:+.2%}): {run['note']}.")
    if not lines:
        return ""
    return f"Why the rows far behind {first['label']} are there:\n" + "\n".join(lines)


_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "h", "<", ">")


def line_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per run, its colour and a line style and marker of its own: runs whose curves
    coincide (a governed run that spends its whole budget is its source run) stay visible,
    a dashed line over a solid one, hollow markers of different shapes on the same points."""
    styles = {}
    for index, name in enumerate(names):
        styles[name] = {"linestyle": _LINESTYLES[index % len(_LINESTYLES)],
                        "marker": _MARKERS[index % len(_MARKERS)], "fillstyle": "none"}
    return styles


def figure(metrics: dict[str, Any]):
    """The plot's figure: validation loss against the step and against the wall time, the
    memory held in a step, and, for the runs with a subspace, rho and T, each only when it
    changed (a constant one is given in the title)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = metrics["runs"]
    styles = line_styles(list(runs))
    subspace = {name for name, run in runs.items() if _has_subspace(run)}
    rhos = {s["rho"] for name in subspace for s in runs[name]["steps"]}
    gaps = {s["update_gap"] for name in subspace for s in runs[name]["steps"]
            if "update_gap" in s}
    # A panel of one flat line says nothing: a constant rho or T goes into the title.
    panels = ["loss", "time", "memory"] + (["rho"] if len(rhos) > 1 else []) \
        + (["gap"] if len(gaps) > 1 else [])
    constants = [f"{symbol} = {next(iter(values)):g}" for symbol, values in
                 (("rho", rhos), ("T", gaps)) if len(values) == 1]
    rows = 1 if len(panels) <= 3 else 2
    legend_rows = math.ceil(len(runs) / max(1, min(4, len(runs))))
    legend_height = 0.25 * legend_rows + 0.15  # inches below the panels
    fig, grid = plt.subplots(rows, 3, figsize=(16, 4 * rows + 0.6 + legend_height),
                             squeeze=False)
    axes = dict(zip(panels, grid.flat))
    for unused in list(grid.flat)[len(panels):]:
        unused.set_axis_off()
    for name, run in runs.items():
        style = {"color": run["color"], "label": run["label"], **styles[name]}
        evals = run["evaluations"]
        axes["loss"].plot([e["step"] for e in evals], [e["val_loss"] for e in evals], **style)
        axes["time"].plot([e["time"] for e in evals], [e["val_loss"] for e in evals], **style)
        for d in run["decisions"]:
            if d["action"] != "continue":
                axes["loss"].plot(d["step"], d["loss"],
                                  marker="x" if d["action"] == "stop" else "^",
                                  color=run["color"], markersize=9, linestyle="none")
        steps = [s["step"] for s in run["steps"]]
        line = {"color": run["color"], "linestyle": style["linestyle"]}
        axes["memory"].plot(steps, [_mb(s["held_bytes"]) for s in run["steps"]], **line)
        if name in subspace:
            if "rho" in axes:
                axes["rho"].plot(steps, [s["rho"] for s in run["steps"]], **line)
            if "gap" in axes:
                axes["gap"].plot(steps, [s["update_gap"] for s in run["steps"]], **line)
    for key in ("loss", "time"):
        _zoom_on_the_end(axes[key], runs.values())
    axes["loss"].set(title="validation loss (x: governor stop, ^: reallocation)",
                     xlabel="step", ylabel="loss (nats/byte)")
    axes["time"].set(title="validation loss against wall time", xlabel="seconds",
                     ylabel="loss (nats/byte)")
    axes["memory"].set(title="held in a step: weights + gradients + optimizer state",
                       xlabel="step", ylabel="MB")
    if "rho" in axes:
        axes["rho"].set(title="rho: state-full fraction of the projected weights",
                        xlabel="step", ylabel="rho")
    if "gap" in axes:
        axes["gap"].set(title="T: steps between subspace changes", xlabel="step", ylabel="T")
    for key in panels:
        axes[key].grid(alpha=0.3)
    # One legend for the panels, below them: a dozen rows' legends inside the panels cover
    # the curves they name. The loss panel has a line for every run.
    handles, labels = axes["loss"].get_legend_handles_labels()
    columns = max(1, min(4, len(labels)))
    fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    fig.suptitle(_title(metrics) + (f"\n{' and '.join(constants)} throughout, in every run "
                                     "with a subspace" if constants else ""))
    fig.tight_layout(rect=(0, legend_height / fig.get_figheight(), 1, 1))
    return fig


def plot(metrics: dict[str, Any], path: Path) -> Optional[Path]:
    """:func:`figure` written to ``path``; None without matplotlib."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = figure(metrics)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _has_subspace(run: dict[str, Any]) -> bool:
    """Whether the run's optimizer keeps state on a part of its projected weights only (a rho
    strictly between 0 and 1 at some step): the runs the rho and T panels are about. DQT
    with every code state-full (rho 1) or none (rho 0) has no subspace to change."""
    return any(0.0 < s.get("rho", 0.0) < 1.0 for s in run["steps"])


def _zoom_on_the_end(ax, runs) -> None:
    """Cut the first evaluations' losses (near ln 256 = 5.5) off the y axis: the runs differ
    by a few hundredths at the end, which a full-range axis flattens into one line."""
    tails = [[e["val_loss"] for e in run["evaluations"]] for run in runs]
    low = min(min(t) for t in tails)
    high = max(t[min(len(t) - 1, len(t) // 4)] for t in tails)
    if high > low:
        ax.set_ylim(low - 0.05 * (high - low), high)


def _title(metrics: dict[str, Any]) -> str:
    """The model, the run's shape, the learning rates the runs used (one pair when they
    share it, tuned or given) and the machine."""
    c = metrics["config"]
    fp = metrics["fingerprint"]
    where = fp.get("gpu") or f"{fp['cpu']}, {fp['threads']} threads"
    runs = list(metrics["runs"].values())
    lrs = {(run["config"]["lr"], run["config"]["matrix_lr_ratio"]) for run in runs}
    tuned = any(run.get("tuned") for run in runs)
    if len(lrs) == 1:
        lr, ratio = next(iter(lrs))
        lr = f"lr {lr:g} (matrices x{ratio:g}){', tuned' if tuned else ''}"
    else:
        lr = "lr tuned per optimizer (see the table)"
    return (f"{c['model']} model, {c['steps']} steps of {c['batch_size']}x{c['seq_len']} bytes, "
            f"{lr}; {where}")
