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
from typing import Any, Optional, Sequence

import torch

from frugal_kernels.lab import tuned as tuned_lrs
from frugal_kernels.lab.corpus import TokenDataset, load_corpus
from frugal_kernels.model import LlamaForCausalLM
from frugal_kernels.nn import quantize_
from frugal_kernels.optim import DQT, FRUGAL, AdaFRUGAL, BAdam, step_in_backward
from frugal_kernels.lab.peers import PEERS, missing
from frugal_kernels.lab.train import OptimizerFactory, RunResult, TrainConfig, lr_groups, train

__all__ = ["DEFAULTS", "DEFAULT_RUNS", "DemoOptimizer", "OPTIMIZERS", "available", "collect_metrics", "plot",
           "resolve", "run_config", "run_demo", "run_train", "table", "write"]

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
    row that runs the same optimizer another way.
    """

    label: str
    color: str
    make: OptimizerFactory
    budget_from: Optional[str] = None
    governor: dict[str, Any] = field(default_factory=dict)
    requires: Optional[tuple[str, str]] = None
    tuned_as: Optional[str] = None


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
                                           tuned_as="adamw")
        rows[f"dqt{bits}-frugal"] = DemoOptimizer(f"DQT {width} + FRUGAL rho=0.25",
                                                  with_frugal, _dqt(bits, "frugal"),
                                                  tuned_as="adamw")
    rows["dqt4-frugal+inbwd"] = DemoOptimizer("DQT 4-bit + FRUGAL rho=0.25, step in backward",
                                              "darkviolet", _dqt(4, "frugal", in_backward=True),
                                              tuned_as="adamw")
    return rows


OPTIMIZERS: dict[str, DemoOptimizer] = {
    "adamw": DemoOptimizer("AdamW", "tab:gray", _adamw),
    "frugal": DemoOptimizer("FRUGAL rho=0.25", "tab:blue", _frugal),
    # The same optimizer, each tensor stepped in backward: the frugal row's loss with one
    # gradient alive at a time; it takes the frugal row's tuning.
    "frugal+inbwd": DemoOptimizer("FRUGAL rho=0.25, step in backward", "deepskyblue",
                                  _frugal_in_backward, tuned_as="frugal"),
    "adafrugal": DemoOptimizer("AdaFRUGAL rho 0.25->0.05", "tab:orange", _adafrugal),
    "adafrugal+governor": DemoOptimizer("AdaFRUGAL+governor", "tab:red", _adafrugal,
                                        budget_from="adafrugal"),
    "badam": DemoOptimizer(f"BAdam K={BADAM_SWITCH_EVERY}", "tab:green", _badam),
    # Not swept: it takes BAdam's tuned lr.
    "badam+frugal": DemoOptimizer(f"BAdam+FRUGAL K={BADAM_SWITCH_EVERY} rho=0.25", "limegreen",
                                  _badam_frugal, tuned_as="badam"),
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


def run_demo(config: TrainConfig = DEFAULTS, names: Sequence[str] = DEFAULT_RUNS,
             out: Optional[Path] = None, progress: bool | str = True,
             tuned: bool = True) -> dict[str, Any]:
    """Train one copy of the same initial model per optimizer in ``names`` (those whose
    package is installed); write ``metrics.json`` and ``demo.png`` into ``out`` (default
    ``runs/demo-<time>``). With ``tuned``, each optimizer runs at its recorded learning rates
    (:func:`run_config`), else all at ``config.lr`` and ``config.matrix_lr_ratio``.

    Returns the metrics (what ``metrics.json`` holds) with ``"out"`` and ``"files"`` added.
    """
    names = available(resolve(names))
    out = Path(out) if out is not None else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    data = load_corpus(config.data, max_bytes=config.max_bytes)
    initial = LlamaForCausalLM(config.model_config(data.vocab_size), seed=config.seed)
    started = time.perf_counter()
    results: dict[str, RunResult] = {}
    for name in names:
        entry = OPTIMIZERS[name]
        named_config = run_config(config, name, tuned)
        if entry.budget_from is not None:
            named_config = dataclasses.replace(named_config,
                                               flop_budget=results[entry.budget_from].flops,
                                               governor=dict(entry.governor))
        results[name] = train(named_config, entry.make, model=copy.deepcopy(initial), data=data,
                              name=entry.label, progress=progress)
    spreads = {name: tuned_for(config, name) for name in names} if tuned else {}
    metrics = collect_metrics(config, data, results, time.perf_counter() - started, spreads)
    return {**metrics, "out": str(out), "files": write(metrics, out, "demo")}


def run_train(config: TrainConfig, name: str = "adafrugal", *,
              data: Optional[TokenDataset] = None, out: Optional[Path] = None,
              progress: bool | str = True, save_model: bool = False) -> dict[str, Any]:
    """``frugal-kernels train``: train a fresh model with the optimizer ``name`` of
    :data:`OPTIMIZERS`, under the compute governor when ``config.flop_budget`` is set, on
    ``data`` (default ``load_corpus(config.data)``); write ``metrics.json``, ``train.png``
    and, with ``save_model``, the trained weights ``model.pt`` into ``out`` (default
    ``runs/train-<time>``). A parallel run (``config.parallel``, every rank calling this)
    writes from its first rank.

    Returns the metrics (what ``metrics.json`` holds) with ``"out"`` and ``"files"`` added.
    """
    entry = OPTIMIZERS[name]
    if entry.budget_from is not None:
        raise ValueError(f"{name!r} takes its budget from the {entry.budget_from!r} run; "
                         "train that one, with config.flop_budget for a governed run")
    reason = missing(entry.requires)
    if reason is not None:
        raise ValueError(f"{name!r} cannot run here: {reason}")
    out = Path(out) if out is not None else Path("runs") / time.strftime("train-%Y%m%d-%H%M%S")
    if data is None:
        data = load_corpus(config.data, max_bytes=config.max_bytes)
    model = LlamaForCausalLM(config.model_config(data.vocab_size), seed=config.seed)
    started = time.perf_counter()
    result = train(config, entry.make, model=model, data=data, name=entry.label,
                   progress=progress)
    metrics = collect_metrics(config, data, {name: result}, time.perf_counter() - started)
    # A parallel run (config.parallel) writes from its first rank only.
    first = config.parallel is None or torch.distributed.get_rank() == 0
    files = write(metrics, out, "train") if first else []
    if save_model:
        state = model.state_dict()
        if config.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 get_model_state_dict)

            # The whole weights, gathered on the first rank (every rank takes part).
            state = get_model_state_dict(model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        if first:
            torch.save(state, out / "model.pt")
            files.append(str(out / "model.pt"))
    return {**metrics, "out": str(out), "files": files}


def collect_metrics(config: TrainConfig, data: TokenDataset, results: dict[str, RunResult],
                    wall_time: float,
                    tuned: Optional[dict[str, Optional[dict[str, Any]]]] = None) -> dict[str, Any]:
    """What ``metrics.json`` holds: the machine, the data, the settings and every run;
    ``tuned`` (per run) the tuned.json record its learning rates came from."""
    from frugal_kernels.bench.fingerprint import fingerprint

    tuned = tuned or {}
    runs = {}
    for name, result in results.items():
        entry = OPTIMIZERS[name]
        runs[name] = {"label": entry.label, "color": entry.color,
                      "budget_from": entry.budget_from, "tuned": tuned.get(name),
                      **result.to_dict()}
    return {
        "command": " ".join(sys.argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "wall_time": wall_time,
        "fingerprint": fingerprint(torch.device(config.device)),
        "data": {"source": data.source, "digest": data.digest,
                 "train_tokens": len(data.train), "validation_tokens": len(data.validation)},
        "config": dataclasses.asdict(config),
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
            f"{_mb(s['held_bytes']):.2f}", f"{_mb(s['state_bytes']):.2f}",
            f"{_mb(s['peak_memory']):.0f}",
            f"{s['step_time'] * 1e3:.0f}", f"{s['optimizer_share']:.1%}", f"{s['flops']:.3g}",
        ])
    return header, rows


def table(metrics: dict[str, Any]) -> str:
    """The runs side by side, as a markdown table, with a note on each governed run.

    Losses are compared with the first run's (AdamW in the default demo)."""
    runs = metrics["runs"]
    first = next(iter(runs.values()))
    header, rows = _rows(metrics)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    kind = first["summary"]["peak_memory_kind"]
    lines.append(f"\nheld MB: the weights, gradients and optimizer state held during a step "
                 f"(the most over the run, each storage counted once); state MB: the "
                 f"optimizer's state tensors at the end; peak MB: "
                 f"{_PEAK_MEANING.get(kind, kind)}; ms/step and optimizer share: from the "
                 f"median step and optimizer-step times; lr: of the embeddings, norms and "
                 f"head (of the matrices).")
    verdict = _verdict(metrics)
    if verdict:
        lines.append("\n" + verdict)
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


def _verdict(metrics: dict[str, Any]) -> str:
    """Which runs differ from the first by less than the seed-to-seed spread the sweep behind
    tuned.json measured (its seeds' range at each one's best setting; of two runs, the larger
    spread counts). Empty unless the first run and another carry a spread."""
    runs = list(metrics["runs"].values())
    first = runs[0]
    if first.get("tuned") is None:
        return ""
    base = first["summary"]["final_val_loss"]
    within, beyond = [], []
    for run in runs[1:]:
        if run.get("tuned") is None or run["budget_from"] is not None:
            continue
        difference = run["summary"]["final_val_loss"] - base
        spread = max(run["tuned"]["spread"], first["tuned"]["spread"])
        text = f"{run['label']} ({difference / base:+.2%}, spread {spread / base:.2%})"
        (within if abs(difference) <= spread else beyond).append(text)
    if not within and not beyond:
        return ""
    settings = first["tuned"]["settings"]
    lines = [f"Against {first['label']}, within the seed-to-seed spread (the range over "
             f"{len(settings['seeds'])} seeds in the sweep behind tuned.json): "
             f"{', '.join(within) or 'none'}; beyond it: {', '.join(beyond) or 'none'}."]
    if not tuned_lrs.comparable(settings["config"], metrics["config"]):
        lines.append("(This run's settings differ from the sweep's, so the spread is only a "
                     "guide.)")
    return " ".join(lines)


def plot(metrics: dict[str, Any], path: Path) -> Optional[Path]:
    """Validation loss, optimizer state, rho and T against the step; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = metrics["runs"].values()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (loss_ax, state_ax), (rho_ax, gap_ax) = axes
    for run in runs:
        style = {"color": run["color"], "label": run["label"]}
        if run["budget_from"] is not None:
            style["linestyle"] = "--"
        evals = run["evaluations"]
        loss_ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], marker=".",
                     **style)
        for d in run["decisions"]:
            if d["action"] != "continue":
                loss_ax.plot(d["step"], d["loss"], marker="x" if d["action"] == "stop" else "^",
                             color=run["color"], markersize=9, linestyle="none")
        steps = [s["step"] for s in run["steps"]]
        state_ax.plot(steps, [_mb(s["held_bytes"]) for s in run["steps"]], **style)
        state_ax.plot(steps, [_mb(s["state_bytes"]) for s in run["steps"]], linestyle=":",
                      color=run["color"])
        if _has_subspace(run):
            rho_ax.plot(steps, [s["rho"] for s in run["steps"]], **style)
            gap_ax.plot(steps, [s["update_gap"] for s in run["steps"]], **style)
    _zoom_on_the_end(loss_ax, runs)
    loss_ax.set(title="validation loss (x: governor stop, ^: reallocation)", xlabel="step",
                ylabel="loss (nats/byte)")
    state_ax.set(title="held in a step: weights + gradients + state (dotted: state alone)",
                 xlabel="step", ylabel="MB")
    rho_ax.set(title="rho: state-full fraction of the projected weights", xlabel="step",
               ylabel="rho")
    gap_ax.set(title="T: steps between subspace changes", xlabel="step", ylabel="T")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    # One legend for the four panels, below them: a dozen rows' legends inside the panels
    # cover the curves they name. The loss panel has a line for every run.
    handles, labels = loss_ax.get_legend_handles_labels()
    columns = max(1, min(4, len(labels)))
    fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    fig.suptitle(_title(metrics))
    legend_rows = math.ceil(len(labels) / columns)
    fig.tight_layout(rect=(0, 0.025 * legend_rows + 0.01, 1, 1))
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
    c = metrics["config"]
    fp = metrics["fingerprint"]
    where = fp.get("gpu") or f"{fp['cpu']}, {fp['threads']} threads"
    lrs = {(run["config"]["lr"], run["config"]["matrix_lr_ratio"])
           for run in metrics["runs"].values()}
    lr = (f"lr {c['lr']:g} (matrices x{c['matrix_lr_ratio']:g})" if len(lrs) == 1
          else "lr tuned per optimizer")
    return (f"{c['model']} model, {c['steps']} steps of {c['batch_size']}x{c['seq_len']} bytes, "
            f"{lr}; {where}")
