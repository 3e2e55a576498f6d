"""Tune the compute governor's stop settings on corpora it is not judged on.

The governor (docs/governor.md) is judged on the fine-tuning task (``frugal-kernels demo
--task finetune``). Its settings -- ``window``, ``patience`` and ``min_improvement`` --
are chosen here on two other corpora, each pretrained from scratch by AdamW at the
demo's tuned lrs long enough to plateau: the demo's own corpus (the standard library
without its tests, cut to ``--max-bytes``) and a second one given by ``--second``
(default: this repository's docs/, English prose about the package, copied beside
``--out`` at the first run so that every run reads the same text).

A governed run equals its ungoverned twin until the governor's first decay: the same
seed, batches and lr (AdamW ignores reallocations, and the twin's WSD decay starts at
``1 / (1 + decay_fraction)`` of its FLOPs, where the governor would decay at the latest).
So each corpus costs one twin run; every setting of the grid is replayed on the twin's
evaluations to find where it would decay, and one governed run per distinct decay point
measures the loss it ends at (its replayed decay point is checked against the real one).

    python tools/governor_tuning.py --out bench/results/governor-tuning-cpu

writes ``<out>.md`` and ``<out>.json`` after each run, and run again it goes on from
``<out>.json``: the twins and governed runs recorded there are not run again. Every
setting of the grid is replayed; ``--run-windows`` limits the governed runs to the decay
points of settings with those windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import json
import os
import shutil
import time
from pathlib import Path

from frugal_kernels import Governor
from frugal_kernels.lab import demo
from frugal_kernels.lab.schedule import twin_cooldown_fraction
from frugal_kernels.lab.train import TrainConfig, train

DECAY_FRACTION = 0.25
WINDOWS = (3, 5, 8)
PATIENCES = (2, 3, 5)
MIN_IMPROVEMENTS = (0.002, 0.005, 0.01, 0.02)
# The Governor's defaults, marked in the tables.
DEFAULT = tuple(inspect.signature(Governor).parameters[name].default
                for name in ("window", "patience", "min_improvement"))


def replay(evaluations: list, budget: float, window: int, patience: int,
           min_improvement: float):
    """The step of the first decay the governor would decide on the twin's evaluations
    (those before the twin's own decay), or None if it decides none there."""
    gov = Governor(budget, window=window, patience=patience, min_improvement=min_improvement,
                   decay_fraction=DECAY_FRACTION)
    for e in evaluations:
        if e["flops"] * (1.0 + DECAY_FRACTION) >= budget:
            return None
        if gov.observe(e["val_loss"], flops=e["flops"], step=e["step"]).action == "decay":
            return e["step"]
    return None


def first_decay(result) -> int | None:
    return next((d["step"] for d in result.decisions if d["action"] == "decay"), None)


def write(out: Path, record: dict) -> None:
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    lines = ["# Governor settings tuned on two corpora (not the fine-tuning task)\n",
             f"Command: `{record['command']}`; {record['started']}, load at the start "
             f"{record['load']}. AdamW at the demo's tuned lrs, from scratch, "
             f"{record['steps']} steps of 16 x 64 tokens, evaluation every "
             f"{record['eval_every']} steps; the twin's WSD decay over its last "
             f"{twin_cooldown_fraction(DECAY_FRACTION):.0%}, the governed runs' "
             f"`decay_fraction={DECAY_FRACTION}`.\n"]
    for name, corpus in record["corpora"].items():
        twin = corpus["twin"]
        lines += [f"## {name}: {corpus['source']}\n",
                  f"Twin: final val loss {twin['final_val_loss']:.4f}, best "
                  f"{twin['best_val_loss']:.4f} at step {twin['best_step']}, "
                  f"{twin['flops']:.3g} FLOPs, {twin['seconds']:.0f} s.\n",
                  "| window | patience | min_improvement | decays at step | FLOPs vs twin | "
                  "loss vs twin |", "|---|---|---|---|---|---|"]
        for s in corpus["settings"]:
            run = corpus["runs"].get(str(s["decay_step"]))
            flops = "100%" if s["decay_step"] is None else (
                f"{run['flops'] / twin['flops']:.1%}" if run else "(not run)")
            loss = "+0.00%" if s["decay_step"] is None else (
                f"{run['final_val_loss'] / twin['final_val_loss'] - 1:+.2%}" if run else "")
            mark = " (default)" if (s["window"], s["patience"], s["min_improvement"]) == DEFAULT \
                else ""
            lines.append(f"| {s['window']} | {s['patience']} | {s['min_improvement']:g}{mark} | "
                         f"{s['decay_step'] if s['decay_step'] is not None else '-'} | "
                         f"{flops} | {loss} |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="path without suffix")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-bytes", type=int, default=100_000)
    parser.add_argument("--second", default=str(Path(__file__).resolve().parents[1] / "docs"))
    parser.add_argument("--run-windows", type=int, nargs="+", default=WINDOWS,
                        help="run the decay points of these windows' settings (default: all)")
    parser.add_argument("--tables-only", action="store_true",
                        help="write <out>.md again from <out>.json, running nothing")
    args = parser.parse_args()
    if args.tables_only:
        write(args.out, json.loads(args.out.with_suffix(".json").read_text()))
        return
    done = (json.loads(args.out.with_suffix(".json").read_text())["corpora"]
            if args.out.with_suffix(".json").exists() else {})
    options = " ".join(f"--{k.replace('_', '-')} " + (" ".join(map(str, v))
                                                      if isinstance(v, (list, tuple)) else str(v))
                       for k, v in vars(args).items())
    record = {"command": f"python tools/governor_tuning.py {options}",
              "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
              "steps": args.steps, "eval_every": args.eval_every, "corpora": {}}
    base = TrainConfig(steps=args.steps, eval_every=args.eval_every, eval_batches=8,
                       cooldown_fraction=twin_cooldown_fraction(DECAY_FRACTION),
                       max_bytes=args.max_bytes)
    base = demo.run_config(base, "adamw")
    make = demo.OPTIMIZERS["adamw"].make
    grid = list(itertools.product(WINDOWS, PATIENCES, MIN_IMPROVEMENTS))
    # The runs read the second corpus from a copy: docs/ may change while they run.
    second = args.out.parent / f"{args.out.name}-corpus"
    if not second.exists():
        shutil.copytree(args.second, second)
    for name, data in (("the demo's corpus", None), ("a second corpus", str(second))):
        config = dataclasses.replace(base, data=data)
        source = (f"{'the standard library without its tests' if data is None else data}"
                  f", first {args.max_bytes} bytes")
        if name in done and done[name]["source"] == source:
            corpus = {**done[name], "source": source}
        else:
            started = time.perf_counter()
            run = train(config, make, name=f"twin ({name})", progress=False)
            best = min(run.evaluations, key=lambda e: e["val_loss"])
            corpus = {"source": source, "runs": {},
                      "twin": {"final_val_loss": run.final_val_loss, "flops": run.flops,
                               "best_val_loss": best["val_loss"], "best_step": best["step"],
                               "seconds": time.perf_counter() - started,
                               "evaluations": run.evaluations}}
        twin = corpus["twin"]
        corpus["settings"] = [
            {"window": w, "patience": p, "min_improvement": m,
             "decay_step": replay(twin["evaluations"], twin["flops"], w, p, m)}
            for w, p, m in grid]
        record["corpora"][name] = corpus
        write(args.out, record)
        steps = {s["decay_step"] for s in corpus["settings"] if s["window"] in args.run_windows}
        for step in sorted(steps - {None} - {int(k) for k in corpus["runs"]}):
            s = next(s for s in corpus["settings"] if s["decay_step"] == step)
            governed = dataclasses.replace(config, flop_budget=twin["flops"], governor={
                "decay_fraction": DECAY_FRACTION, "window": s["window"],
                "patience": s["patience"], "min_improvement": s["min_improvement"]})
            run = train(governed, make, name=f"governed ({name}, decay at {step})",
                        progress=False)
            if first_decay(run) != step:
                raise AssertionError(f"the replay put the decay at step {step}, the run at "
                                     f"{first_decay(run)}")
            corpus["runs"][str(step)] = {"final_val_loss": run.final_val_loss,
                                         "flops": run.flops, "stop": run.stop_reason}
            write(args.out, record)
            print(f"{name}: decay at {step}: {run.flops / twin['flops']:.1%} of the FLOPs, "
                  f"loss {run.final_val_loss / twin['final_val_loss'] - 1:+.2%}", flush=True)


if __name__ == "__main__":
    main()
