"""The demo's optimizers: one :class:`DemoOptimizer` per row (how its optimizer is built, how
it is drawn, why it may end far from AdamW), the peers' rows, the runs of a plain
``frugal-kernels demo``, the default settings and the tuned learning rates each run takes.

Adding an optimizer to the demo (and to ``train`` and ``sweep``) is one entry in
:data:`OPTIMIZERS`. Each optimizer runs at the learning rates recorded for it, the task and the
model preset in ``tuned.json`` (:mod:`frugal_kernels.lab.tuned`, from ``frugal-kernels sweep``)
unless ``tuned=False``.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from frugal_kernels.lab import tuned as tuned_lrs
from frugal_kernels.lab.peers import PEERS, missing
from frugal_kernels.lab.train import OptimizerFactory, TrainConfig, lr_groups
from frugal_kernels.model import LlamaConfig
from frugal_kernels.nn import quantize_
from frugal_kernels.optim import DQT, FRUGAL, AdaFRUGAL, BAdam, step_in_backward
from frugal_kernels.optim.swap import swap

__all__ = ["BADAM_SWITCH_EVERY", "DEFAULTS", "DEFAULT_RUNS", "DemoOptimizer", "OPTIMIZERS",
           "ROW_SELECTION", "UPDATE_GAP", "available", "resolve", "row_config", "run_config",
           "tuned_for"]

# The paper's T = 200 is for runs of tens of thousands of steps. On short runs each subspace
# change costs (the new state-full blocks restart their moments: at 300 x 16, T = 10 / 50 / 200
# gave 1.907 / 1.878 / 1.832, docs/demo.md), so the demo's 200 steps get one change, at T = 100.
UPDATE_GAP = 100

# BAdam's blocks on the demo model ("small": 4 layers) are the embedding, the layers and the
# head: 6 blocks. Switching every 20 steps (TrainConfig.badam_switch_every's default) gives
# the 200 steps 10 switches, so every block trains at least once; the published default
# (K = 100 on runs of thousands of steps) would leave four of the six blocks untrained.
BADAM_SWITCH_EVERY = TrainConfig.badam_switch_every


@dataclass(frozen=True)
class DemoOptimizer:
    """One run of the demo: how its optimizer is built and how it is drawn.

    ``make(model, config)`` returns the optimizer (``config.steps`` is the run length, for
    schedules such as AdaFRUGAL's rho). A run with ``budget_from`` is governed: its FLOP
    budget is what the run named there spent, and ``governor`` holds the keyword arguments of
    its :class:`~frugal_kernels.Governor`. ``requires`` names the (module, pip distribution)
    an optional row needs; without it the row is skipped with a notice. ``tuned_as`` names
    the row whose tuned lrs this one takes where no sweep covered it itself (a governed run
    takes its budget source's), for a row that runs the same optimizer another way or was
    not swept. ``describe(run)``, where given, is the
    label of a finished run (its record in metrics.json), for a label that says what the
    run did (the rho AdaFRUGAL reached); ``note`` (a string, or a function of the run) says
    why the row may end far from AdamW, printed under the table when it does. A row with
    ``selects`` trains on online-selected batches (``TrainConfig.select``: the config's
    policy, else :data:`ROW_SELECTION`; :func:`row_config`); its ``twin`` is the row it is compared
    with, the same optimizer without selection, whose FLOPs the demo gives it
    (:func:`~frugal_kernels.lab.train.equal_flops_steps`) and which :func:`resolve` runs
    before it.
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
    selects: bool = False
    twin: Optional[str] = None


def _adamw(model, config: TrainConfig) -> torch.optim.Optimizer:
    # torch's fused AdamW exists for CPU and CUDA tensors; elsewhere (None) torch picks.
    fused = True if torch.device(config.device).type in ("cpu", "cuda") else None
    return torch.optim.AdamW(lr_groups(model, config), lr=config.lr,
                             weight_decay=config.weight_decay, fused=fused)


def _frugal(model, config: TrainConfig) -> FRUGAL:
    return FRUGAL(lr_groups(model, config), lr=config.lr, weight_decay=config.weight_decay,
                  density=0.25, update_gap=UPDATE_GAP, projection="blocks")


def _frugal_int8(model, config: TrainConfig) -> FRUGAL:
    return FRUGAL(lr_groups(model, config), lr=config.lr, weight_decay=config.weight_decay,
                  density=0.25, update_gap=UPDATE_GAP, projection="blocks", state_dtype="int8")


def _adamw_int8(model, config: TrainConfig) -> torch.optim.Optimizer:
    """torch's AdamW with its step swapped for ours on blockwise int8 moments."""
    return swap(torch.optim.AdamW(lr_groups(model, config), lr=config.lr,
                                  weight_decay=config.weight_decay), state_dtype="int8")


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
    return _with_matrix_lr(BAdam(model, lr=config.lr, weight_decay=config.weight_decay,
                                 switch_every=config.badam_switch_every, include_embedding=True,
                                 include_head=True, seed=config.seed), config)


def _badam_frugal(model, config: TrainConfig) -> BAdam:
    return _with_matrix_lr(BAdam(model, lr=config.lr, weight_decay=config.weight_decay,
                                 switch_every=config.badam_switch_every, include_embedding=True,
                                 include_head=True, seed=config.seed, inner="frugal",
                                 density=0.25, projection="columns"), config)


def _with_matrix_lr(opt: BAdam, config: TrainConfig) -> BAdam:
    """The layers' blocks at ``matrix_lr_ratio * lr``, the embedding and the head at ``lr``,
    as :func:`lr_groups` gives the other rows. BAdam's param groups are its blocks, so a
    layer's norms (a few hundred of its parameters) take the matrices' lr here."""
    for group in opt.param_groups:
        if group["block"] not in ("embedding", "head"):
            group["lr"] = config.lr * config.matrix_lr_ratio
    return opt


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
    backward. Each takes AdamW's tuned lrs where no sweep covered it."""
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
            f"embedding, each of the {layers} layers, the head; K = {_switch_every(run)} "
            f"steps each), so each weight trains for about 1/{blocks} of the steps: from "
            f"scratch that leaves it far behind, and a trained model needs fewer updates")


def _switch_every(run: dict[str, Any]) -> int:
    # Runs recorded before the option existed ran at the default.
    return run["config"].get("badam_switch_every", BADAM_SWITCH_EVERY)


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
    # Our 8-bit moments (blocks of 256 along rows, fp32 scales): each takes its fp32 twin's
    # tuning, so that the rows differ only by the state's precision.
    "frugal-8bit": DemoOptimizer("FRUGAL rho=0.25, int8 state", "royalblue", _frugal_int8,
                                 tuned_as="frugal",
                                 note="the FRUGAL row with its AdamW moments as int8 codes "
                                      "and one fp32 scale per 256 elements"),
    "adamw-8bit": DemoOptimizer("AdamW, int8 state (ours)", "darkgray", _adamw_int8,
                                tuned_as="adamw",
                                note="torch's AdamW swapped onto our fused step with int8 "
                                     "moments"),
    "adafrugal": DemoOptimizer("AdaFRUGAL", "tab:orange", _adafrugal,
                               describe=_rho_reached("AdaFRUGAL"), note=_adafrugal_note),
    "adafrugal+governor": DemoOptimizer("AdaFRUGAL+governor", "tab:red", _adafrugal,
                                        budget_from="adafrugal",
                                        describe=_rho_reached("AdaFRUGAL+governor")),
    "badam": DemoOptimizer(f"BAdam K={BADAM_SWITCH_EVERY}", "tab:green", _badam,
                           describe=lambda run: f"BAdam K={_switch_every(run)}",
                           note=_badam_note),
    # BAdam's tuned lrs where no sweep covered it.
    "badam+frugal": DemoOptimizer(f"BAdam+FRUGAL K={BADAM_SWITCH_EVERY} rho=0.25", "limegreen",
                                  _badam_frugal, tuned_as="badam",
                                  describe=lambda run: f"BAdam+FRUGAL K={_switch_every(run)} "
                                                       "rho=0.25",
                                  note=lambda run: _badam_note(run) + "; FRUGAL runs inside "
                                                   "the active block"),
    **_dqt_rows(),
}


def _selecting(source: str, color: str) -> DemoOptimizer:
    """The ``source`` row trained on online-selected batches, at its tuning."""
    entry = OPTIMIZERS[source]
    return DemoOptimizer(
        f"{entry.label}+select", color, entry.make, tuned_as=source, selects=True,
        twin=source, describe=lambda run: f"{entry.label}+select ({_selection(run)})",
        note="each step scores --candidates batches and trains on the --keep fraction the "
             "policy picks; the scoring counts in its FLOPs, and the demo gives it the FLOPs "
             "of its twin without selection (--select-at-equal-steps: its steps)")


def _selection(run: dict[str, Any]) -> str:
    c = run["config"]
    return f"{c['select']}, keep {c['keep']:g} of {c['candidates']}"


OPTIMIZERS["adamw+select"] = _selecting("adamw", "silver")
OPTIMIZERS["frugal+select"] = _selecting("frugal", "lightsteelblue")


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
# Nor the +select rows, which pay on noisy data (`--optimizers adamw adamw+select
# --data-noise 0.3`), nor the int8-state twins (`--optimizers frugal frugal-8bit`), so that
# the default demo keeps its five minutes.
DEFAULT_RUNS = tuple(name for name in OPTIMIZERS
                     if (not name.startswith("dqt") or name in ("dqt4", "dqt4-frugal"))
                     and not OPTIMIZERS[name].selects
                     and name not in ("frugal-8bit", "adamw-8bit"))

# TrainConfig's defaults are the demo's (docs/demo.md); each optimizer's two learning rates
# come from tuned.json, where a sweep recorded them for the model preset.
DEFAULTS = TrainConfig()


def resolve(names: Sequence[str]) -> list[str]:
    """``names`` in order, each governed run preceded by the run its budget comes from, each
    selecting run by its twin."""
    ordered: list[str] = []
    for name in names:
        if name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
        source = OPTIMIZERS[name].budget_from or OPTIMIZERS[name].twin
        if source is not None and source not in ordered:
            ordered.append(source)
        if name not in ordered:
            ordered.append(name)
    return ordered


def available(names: Sequence[str], rows: Optional[dict[str, DemoOptimizer]] = None
              ) -> list[str]:
    """``names`` without the rows (of ``rows``, default :data:`OPTIMIZERS`) whose package is
    missing, each skipped with a one-line notice on stderr."""
    rows = OPTIMIZERS if rows is None else rows
    kept = []
    for name in names:
        reason = missing(rows[name].requires)
        if reason is None:
            kept.append(name)
        else:
            print(f"skipping {name}: {reason}", file=sys.stderr)
    return kept


def tuned_for(config: TrainConfig, name: str, rows: Optional[Mapping[str, DemoOptimizer]] = None,
              task: str = "pretrain") -> Optional[dict[str, Any]]:
    """What ``tuned.json`` records for the run ``name`` of ``rows`` (default
    :data:`OPTIMIZERS`) on ``config.model`` in ``task``: the row's own best where a sweep
    covered it, else that of its ``tuned_as``, else that of the run its budget comes from;
    None if none is recorded. ``"row"`` names the row whose record it is."""
    entry = (OPTIMIZERS if rows is None else rows)[name]
    for source in (name, entry.tuned_as, entry.budget_from):
        if source is None:
            continue
        best = tuned_lrs.lookup(config.model, source, task=task)
        if best is not None:
            return {**best, "row": source}
    return None


# What a +select row selects by when the config names no policy: the byte-bigram filter,
# dropping one sequence in 8 of a single batch; of the policies measured at equal FLOPs on
# the demo's corpora (bench/results/selection-cpu.md) the only one that beat its twin on
# the noised corpus without losing to the random control on the clean one.
ROW_SELECTION = {"select": "ngram", "keep": 0.875, "candidates": 1}


def row_config(config: TrainConfig, name: str) -> TrainConfig:
    """``config`` with what the row ``name`` fixes itself: a ``selects`` row selects by
    ``config.select`` (at its ``keep`` and ``candidates``), else by :data:`ROW_SELECTION`."""
    if OPTIMIZERS[name].selects and config.select is None:
        return dataclasses.replace(config, **ROW_SELECTION)
    return config


def run_config(config: TrainConfig, name: str, tuned: bool = True,
               rows: Optional[Mapping[str, DemoOptimizer]] = None,
               task: str = "pretrain") -> TrainConfig:
    """``config`` for the run ``name`` of ``rows`` (default :data:`OPTIMIZERS`): with
    ``tuned``, its lr and matrix lr ratio are the best recorded for ``config.model`` in
    ``task`` (:func:`tuned_for`) where one is recorded."""
    best = tuned_for(config, name, rows, task) if tuned else None
    if best is None:
        return config
    return dataclasses.replace(config, lr=best["lr"], matrix_lr_ratio=best["matrix_lr_ratio"])
