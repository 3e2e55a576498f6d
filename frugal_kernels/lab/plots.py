"""The figure of a run of the demo or ``train``: the validation loss against the step and
the wall time, the memory held in a step, and rho and T of the runs with a subspace."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

from frugal_kernels.lab.report import _mb

__all__ = ["figure", "line_styles", "plot"]


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

