"""What a run of the demo, ``train`` or the sweep reports: what ``metrics.json`` holds
(:func:`collect_metrics`) and the table of the runs side by side with its verdict against
the first run, a recommendation per memory budget and why the rows far behind are there
(:func:`table`)."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Mapping, Optional, Sequence

import torch

from frugal_kernels.lab import tuned as tuned_lrs
from frugal_kernels.lab.corpus import TokenDataset
from frugal_kernels.lab.registry import OPTIMIZERS
from frugal_kernels.lab.train import RunResult, TrainConfig

__all__ = ["BUDGETS", "FAR", "collect_metrics", "table"]


def collect_metrics(config: TrainConfig, data: TokenDataset, results: dict[str, RunResult],
                    wall_time: float,
                    tuned: Optional[dict[str, Optional[dict[str, Any]]]] = None,
                    planned: Optional[Sequence[str]] = None,
                    rows: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """What ``metrics.json`` holds: the machine, the data, the settings and every run;
    ``tuned`` (per run) the tuned.json record its learning rates came from; ``planned`` the
    runs the demo was to train, of which ``results`` are those finished so far; ``rows``
    the registry the runs' names come from (default the demo's)."""
    from frugal_kernels.bench.fingerprint import fingerprint

    tuned = tuned or {}
    runs = {}
    for name, result in results.items():
        entry = (OPTIMIZERS if rows is None else rows)[name]
        run = {"label": entry.label, "color": entry.color,
               "budget_from": entry.budget_from, "twin": getattr(entry, "twin", None),
               "tuned": tuned.get(name),
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
    lines += _selection_lines(runs)
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


def _selection_lines(runs: dict[str, Any]) -> list[str]:
    """Per selecting run: its steps and FLOPs against its twin's, and on a noised corpus the
    noise among the sequences offered and those kept."""
    lines = []
    for run in runs.values():
        twin = runs.get(run.get("twin"))
        s = run["summary"]
        if twin is not None:
            t = twin["summary"]
            lines.append(f"\n{run['label']}: {s['steps']} steps for {s['flops']:.4g} FLOPs, "
                         f"scoring counted ({t['steps']} steps for {t['flops']:.4g} without "
                         f"selection), val loss {s['final_val_loss'] / t['final_val_loss'] - 1:+.2%} "
                         f"against {twin['label']}.")
        noise = s.get("noise")
        if noise and run["config"].get("select"):
            kinds = [k[len("kept_"):] for k in noise if k.startswith("kept_")]
            lines.append("Noise in its batches: " + "; ".join(
                f"{kind} {noise['offered_' + kind]:.1%} of the sequences offered, "
                f"{noise['kept_' + kind]:.1%} of those kept" for kind in kinds) + ".")
    return lines


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
    seed-to-seed spread the sweep behind tuned.json measured: each run's own, the seeds'
    range at the (lr, matrix lr ratio) the sweep found best for it and the run used (of two
    runs, the larger spread counts). Runs without a spread (lrs not tuned, a one-seed sweep)
    are put as lower or higher, with that caveat; a caveat is added when the sweep's
    settings (or, fine-tuning, its base) differ from the run's."""
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
        other_base = (settings is not None and "base" in metrics
                      and settings.get("base", {}).get("hash") != metrics["base"].get("hash"))
        if settings and (other_base
                         or not tuned_lrs.comparable(settings["config"], metrics["config"])):
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
