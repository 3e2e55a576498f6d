"""The ``frugal-kernels`` command (also ``python -m frugal_kernels``)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import gc
import math
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional


class CommandLineError(Exception):
    """A bad combination of arguments found after parsing: one line on stderr, exit 2."""


def _number(convert: Callable[[str], float], name: str, ok: Callable[[float], bool]):
    """An argparse type: ``convert`` the text and accept it when ``ok``; argparse turns the
    ArgumentTypeError into one line on stderr and exit status 2."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}")
        return value
    parse.__name__ = name  # argparse names the type in its messages
    return parse


_positive_int = _number(int, "a positive integer", lambda v: v >= 1)
_non_negative_int = _number(int, "an integer >= 0", lambda v: v >= 0)
_positive_float = _number(float, "a positive finite number",
                          lambda v: math.isfinite(v) and v > 0)
_non_negative_float = _number(float, "a finite number >= 0",
                              lambda v: math.isfinite(v) and v >= 0)
# The weights, the batches and the optimizers' generators take the seed; the narrowest, 32 bits.
_seed = _number(int, "a seed: an integer in [0, 2**32)", lambda v: 0 <= v < 2**32)


class _Parser(argparse.ArgumentParser):
    """argparse's exit status 2 for a bad argument, with one line on stderr instead of the
    whole usage (a long usage hides the error; --help shows it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _choice(names: List[str], what: str = "optimizer"):
    """An argparse type for one of ``names``, case-insensitive, with the closest names
    suggested for a wrong one (argparse's own message lists every choice, unsorted by
    likeness)."""
    by_lower = {n.lower(): n for n in names}

    def parse(text: str) -> str:
        name = by_lower.get(text.lower())
        if name is not None:
            return name
        close = difflib.get_close_matches(text.lower(), list(by_lower), n=3, cutoff=0.5)
        hint = (f"did you mean {' or '.join(repr(by_lower[c]) for c in close)}? "
                if close else "")
        raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; {hint}choose from "
                                         f"{', '.join(names)}")
    parse.__name__ = what
    return parse


def _data_path(text: str) -> str:
    """A path that exists, or an hf: source when ``datasets`` is installed; what the path
    holds is checked when it is read, still before any training (:func:`_load_data`)."""
    if text.startswith("hf:"):
        try:
            import datasets  # noqa: F401  (only to know that it is there)
        except ImportError:
            raise argparse.ArgumentTypeError(
                f"{text!r} needs the optional package datasets, which is not installed "
                "(pip install datasets)")
        return text
    if not Path(text).expanduser().exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return text


def _load_data(config):
    """The corpus of ``config``, read and checked against its batches before any training:
    an empty file, a folder without text files, /dev/null or too little text is a
    CommandLineError."""
    from frugal_kernels.lab.corpus import load_corpus
    from frugal_kernels.lab.train import check_data

    try:
        data = load_corpus(config.data, max_bytes=config.max_bytes, noise=config.data_noise)
        check_data(data, config)
    except (ValueError, OSError, ImportError) as exc:
        raise CommandLineError(f"--data: {exc}") from None
    return data


def _out(args: argparse.Namespace, command: str, **options):
    """The output folder, made and checked writable before any training (a new one beside
    an --out holding earlier results, unless --overwrite)."""
    from frugal_kernels.lab.output import output_folder

    try:
        out, note = output_folder(args.out, command, args.overwrite, **options)
    except ValueError as exc:
        raise CommandLineError(str(exc)) from None
    if note:
        print(note, file=sys.stderr)
    return out


def _existing_file(text: str, option: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    return text


def _device_name(text: str) -> str:
    """auto, cpu, cuda or cuda:N, refused at once when no GPU can serve it."""
    import torch

    if text in ("auto", "cpu"):
        return text
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (auto, cpu, cuda, cuda:N)")\
            from None
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"{text!r}: CUDA is not available here (torch {torch.__version__}, "
            f"torch.cuda.is_available() is False)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text!r}: there are only {torch.cuda.device_count()} CUDA devices")
    return text


def _bench(args: argparse.Namespace) -> int:
    from frugal_kernels import bench
    from frugal_kernels.bench.report import markdown

    sections = set(args.only or bench.SECTIONS)
    # The host-overhead section runs on a CPU, or on a GPU when --only names it.
    if args.no_overhead or "overhead" not in sections:
        with_overhead = False
    else:
        with_overhead = True if args.only else None
    result = bench.run(device=args.device, quick=args.quick, out=args.out, op_names=args.ops,
                       with_ops="ops" in sections and not args.no_ops,
                       with_optimizers="optimizers" in sections and not args.no_optimizers,
                       with_overhead=with_overhead,
                       with_dqt="dqt" in sections,
                       with_clip="clip" in sections, with_loss="loss" in sections,
                       with_in_backward="in_backward" in sections and not args.no_in_backward,
                       preset=args.preset, rounds=args.rounds, dtypes=args.dtypes,
                       fresh_processes=args.fresh_processes, stem=args.stem, only=args.only,
                       command="frugal-kernels " + " ".join(sys.argv[1:]))
    print(markdown(result))
    print("wrote " + ", ".join(result["files"]))
    return 0


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _train_config(args: argparse.Namespace, base):
    """``base`` with the options given on the command line; ``--steps`` alone scales the
    warmup and the evaluation interval with it."""
    options = {field: getattr(args, field, None) for field in (
        "model", "steps", "batch_size", "seq_len", "lr", "matrix_lr_ratio", "warmup_steps",
        "schedule", "eval_every",
        "eval_batches", "grad_clip", "weight_decay", "seed", "data", "max_bytes", "finetune_bytes",
        "select", "keep", "candidates", "select_reference_steps", "select_reference_model",
        "data_noise", "badam_switch_every")}
    options = {k: v for k, v in options.items() if v is not None}
    if options.get("select") is None and ("keep" in options or "candidates" in options):
        # A +select row's own policy comes with its keep and candidates (ROW_SELECTION).
        raise CommandLineError("--keep and --candidates set a selection: give --select too")
    if args.no_grad_clip:
        options["grad_clip"] = None
    try:
        if args.steps is not None:
            base = base.with_steps(args.steps, warmup_steps=args.warmup_steps,
                                   eval_every=args.eval_every)
        return dataclasses.replace(base, device=_device(args.device), **options)
    except ValueError as exc:  # TrainConfig's checks of the options taken together
        raise CommandLineError(str(exc)) from None


def _progress(args: argparse.Namespace):
    """train()'s progress mode: nothing with --quiet, a line per evaluation with
    --no-progress, else a bar on a terminal and lines elsewhere."""
    if args.quiet:
        return False
    return "lines" if args.no_progress else True


def _demo(args: argparse.Namespace) -> int:
    from frugal_kernels.lab import demo

    if args.task == "finetune":
        return _finetune(args)
    only_finetune = [n for n in args.optimizers or () if n not in demo.OPTIMIZERS]
    if only_finetune:
        raise CommandLineError(f"{', '.join(only_finetune)}: rows of --task finetune only")
    config = _train_config(args, demo.DEFAULTS)
    out = _out(args, "demo")
    data = _load_data(config)
    names = demo.available(demo.resolve(args.optimizers or demo.DEFAULT_RUNS))
    # --lr or --matrix-lr-ratio: every optimizer at the given lrs; else each at its tuned ones.
    tuned = args.lr is None and args.matrix_lr_ratio is None
    print(f"frugal-kernels demo: the {config.model} model, {config.steps} steps of "
          f"{config.batch_size}x{config.seq_len} tokens, on {config.device}, with "
          f"{', '.join(demo.OPTIMIZERS[n].label for n in names)}"
          + (", each at its tuned lr (tuned.json)" if tuned else f", lr {config.lr:g} "
             f"(matrices x{config.matrix_lr_ratio:g})"))
    metrics = demo.run_demo(config, names, out=out, progress=_progress(args), tuned=tuned,
                            data=data, overwrite=True,
                            select_at_equal_steps=args.select_at_equal_steps)
    print()
    print(demo.table(metrics))
    print(f"\n{metrics['wall_time']:.0f} s in all; wrote " + ", ".join(metrics["files"]))
    print(f"results in {metrics['out']}")
    return 0


def _finetune(args: argparse.Namespace) -> int:
    from frugal_kernels.lab import finetune

    not_rows = [n for n in args.optimizers or () if n not in finetune.ROWS]
    if not_rows:
        raise CommandLineError(f"{', '.join(not_rows)}: not a row of --task finetune (its "
                               f"rows: {', '.join(finetune.ROWS)})")
    config = _train_config(args, finetune.DEFAULTS)
    # --lr or --matrix-lr-ratio: every row at the given lrs; else each at its tuned ones.
    tuned = args.lr is None and args.matrix_lr_ratio is None
    print(f"frugal-kernels demo --task finetune: the {config.model} model pretrained for "
          f"{args.base_steps} steps on the standard library without its tests (cached under "
          f"{args.base_cache}), then fine-tuned for {config.steps} steps of "
          f"{config.batch_size}x{config.seq_len} tokens on "
          f"{config.data or 'its test modules'}, on {config.device}, "
          + ("each row at its tuned lrs for the task (tuned.json), else at " if tuned
             else "every row at ")
          + f"lr {config.lr:g} (matrices x{config.matrix_lr_ratio:g})")
    out = _out(args, "demo")
    metrics = finetune.run_finetune(config, args.optimizers or finetune.DEFAULT_RUNS,
                                    out=out, progress=_progress(args),
                                    base_steps=args.base_steps, cache=args.base_cache,
                                    rebuild_base=args.rebuild_base, tuned=tuned)
    print()
    print(finetune.table(metrics))
    print(f"\n{metrics['wall_time']:.0f} s in all; wrote " + ", ".join(metrics["files"]))
    print(f"results in {metrics['out']}")
    return 0


def _launched() -> bool:
    """Whether torchrun (torch.distributed.run) started this process."""
    return all(key in os.environ for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


# What each parallel mode can train: DDP fixes the trainable parameters when it wraps
# the model, and BAdam changes them; FSDP2 hands the optimizer DTensors, which the
# package's optimizers and torch's AdamW take (the peers' are untested there).
_PARALLEL_OPTIMIZERS = {"ddp": ("adamw", "frugal", "adafrugal"),
                        "fsdp": ("adamw", "frugal", "adafrugal", "badam", "badam+frugal")}


def _parallel(args: argparse.Namespace) -> Optional[str]:
    """The parallel mode of ``train``: under torchrun DDP, or FSDP2 with --fsdp; none alone.
    Starts the default process group (gloo on the CPU, NCCL on GPUs) and picks each
    rank's GPU."""
    if not _launched():
        if args.fsdp:
            raise CommandLineError("--fsdp runs under torchrun: torchrun --nproc_per_node=N "
                                   "-m frugal_kernels train --fsdp ...")
        return None
    mode = "fsdp" if args.fsdp else "ddp"
    if args.optimizer not in _PARALLEL_OPTIMIZERS[mode]:
        raise CommandLineError(
            f"--optimizer {args.optimizer} does not run under {mode.upper()} (it runs "
            f"{', '.join(_PARALLEL_OPTIMIZERS[mode])}"
            + ("; BAdam changes the trainable parameters, which DDP fixes: use --fsdp)"
               if mode == "ddp" and args.optimizer.startswith("badam") else ")"))
    import torch
    import torch.distributed as dist

    gpu = _device(args.device).startswith("cuda")
    if gpu:
        args.device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(args.device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if gpu else "gloo")
    return mode


def _train(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    if args.resume is None and args.optimizer is None:
        args.optimizer = "adafrugal"
    parallel = _parallel(args)
    try:
        status = _train_run(args, parallel)
        if parallel is not None:
            # The ranks leave together, with the FSDP/DDP modules that hold the group
            # already freed: a rank that tore its group down while the other still had a
            # collective in flight was seen to abort at exit (SIGABRT, under load in CI).
            gc.collect()
            dist.barrier()
        return status
    finally:
        if parallel is not None:
            dist.destroy_process_group()


def _train_run(args: argparse.Namespace, parallel: Optional[str]) -> int:
    from frugal_kernels.lab import demo, finetune
    from frugal_kernels.lab.train import TrainConfig, check_data, steps_for_budget
    import torch.distributed as dist

    # The first rank speaks for a parallel run.
    say = print if parallel is None or dist.get_rank() == 0 else (lambda *a, **k: None)
    resume = _resume(args, parallel)
    task = (args.task or "pretrain") if resume is None else resume.get("task", "pretrain")
    rows = finetune.ROWS if task == "finetune" else demo.OPTIMIZERS
    if resume is not None:
        args.optimizer = resume["optimizer_name"]
    if args.optimizer not in rows or rows[args.optimizer].budget_from is not None:
        trainable = [n for n, entry in rows.items() if entry.budget_from is None]
        raise CommandLineError(f"--optimizer {args.optimizer} is not a run of --task {task}; "
                               f"choose from {', '.join(trainable)}")
    if task == "finetune" and parallel is not None:
        raise CommandLineError("--task finetune runs in one process, not under torchrun")
    if resume is not None:
        config = TrainConfig(**{**resume["config"], "device": _device(args.device)})
    else:
        defaults = finetune.DEFAULTS if task == "finetune" else TrainConfig()
        config = dataclasses.replace(_train_config(args, defaults), parallel=parallel)
    if parallel is not None and config.batch_size % dist.get_world_size():
        raise CommandLineError(f"--batch-size {config.batch_size} (the global batch) does not "
                               f"split over {dist.get_world_size()} ranks")
    # The row's tuned lrs for the task, if any.
    if resume is None and args.lr is None and args.matrix_lr_ratio is None:
        config = demo.run_config(config, args.optimizer, rows=rows, task=task)
    if resume is None and args.optimizer in demo.OPTIMIZERS:
        config = demo.row_config(config, args.optimizer)  # a +select row selects
    out = None
    if parallel is None or dist.get_rank() == 0:
        # Resuming writes into the checkpoint's folder unless told otherwise.
        if resume is not None and args.out is None:
            args.out, args.overwrite = Path(args.resume).parent, True
        out = _out(args, "train", keep=("checkpoint.pt",) if resume is not None else ())
    if args.governor_select_trial is not None and (args.flop_budget is None
                                                   or config.select is None):
        raise CommandLineError("--governor-select-trial needs --select and --flop-budget")
    model = None
    if task == "finetune":
        try:
            if resume is None:  # the base is the start; a resumed run has its weights
                model, _, _, data = finetune.finetune_setup(
                    config, args.base_steps or finetune.BASE_STEPS, args.base_cache,
                    args.rebuild_base, _progress(args))
            else:
                data = finetune.finetune_data(config)[1]
            check_data(data, config)
        except (ValueError, OSError) as exc:
            raise CommandLineError(f"--data: {exc}") from None
    else:
        data = _load_data(config)
    if resume is None and args.flop_budget is not None:
        governor = {k: v for k, v in (("window", args.governor_window),
                                      ("patience", args.governor_patience),
                                      ("min_improvement", args.governor_min_improvement),
                                      ("select_trial", args.governor_select_trial))
                    if v is not None}
        try:
            config = dataclasses.replace(config, flop_budget=args.flop_budget, governor=governor)
        except ValueError as exc:
            raise CommandLineError(str(exc)) from None
        try:  # a budget that does not pay for one step is refused, --steps or not
            budget_steps = steps_for_budget(args.flop_budget, config, data.vocab_size)
        except ValueError as exc:
            raise CommandLineError(f"--flop-budget: {exc}") from None
        if args.steps is None:  # as long as the budget pays for
            config = config.with_steps(budget_steps, warmup_steps=args.warmup_steps,
                                       eval_every=args.eval_every)
    say(f"frugal-kernels train: {rows[args.optimizer].label} on the {config.model} "
        f"model ({config.model_config(data.vocab_size).num_params():,} parameters), "
        f"{config.steps} steps of {config.batch_size}x{config.seq_len} tokens on "
        f"{config.device}"
        + (f", fine-tuning the base of --task finetune on {data.source}"
           if task == "finetune" else "")
        + (f", under a budget of {config.flop_budget:.4g} FLOPs" if config.flop_budget else "")
        + (f", selecting by {config.select} (keep {config.keep:g} of {config.candidates} "
           "batches)" if config.select else "")
        + (f", {config.data_noise:.0%} of the documents noised" if config.data_noise else "")
        + (f", {parallel.upper()} over {dist.get_world_size()} ranks" if parallel else "")
        + (f", resumed from step {resume['step']}" if resume is not None else ""))
    try:
        metrics = demo.run_train(config, args.optimizer, data=data, out=out,
                                 progress=_progress(args), save_model=args.save_model,
                                 overwrite=True, resume=resume, log=args.log, model=model,
                                 rows=rows, task=task)
    except ValueError as exc:  # a peer whose package is missing, a logger not installed
        raise CommandLineError(str(exc)) from None
    run = metrics["runs"][args.optimizer]
    say()
    say(demo.table(metrics))
    say(f"\n{run['stop_reason']}")
    if run["decisions"]:
        actions = [d["action"] for d in run["decisions"]]
        say(f"governor: {len(actions)} evaluations, {actions.count('reallocate')} "
            f"reallocations, {actions.count('select')} selection switches; "
            f"{run['summary']['flops']:.4g} of {config.flop_budget:.4g} FLOPs spent")
    say("wrote " + ", ".join(metrics["files"]))
    return 0


# Options that set up a run; a resumed run takes them all from its checkpoint.
_RUN_OPTIONS = ("model", "steps", "batch_size", "seq_len", "lr", "matrix_lr_ratio",
                "warmup_steps", "schedule", "eval_every", "eval_batches", "grad_clip",
                "weight_decay", "seed", "data", "max_bytes", "finetune_bytes", "flop_budget", "governor_window",
                "governor_patience", "governor_min_improvement", "governor_select_trial",
                "select", "keep", "candidates", "select_reference_steps",
                "select_reference_model", "data_noise", "task", "base_steps",
                "badam_switch_every")


def _resume(args: argparse.Namespace, parallel: Optional[str]):
    """The checkpoint of --resume, read and checked before anything trains; None without
    --resume."""
    if args.resume is None:
        return None
    given = [f"--{o.replace('_', '-')}" for o in _RUN_OPTIONS if getattr(args, o) is not None]
    given += ["--no-grad-clip"] if args.no_grad_clip else []
    given += ["--optimizer"] if args.optimizer is not None else []
    if given:
        raise CommandLineError(f"--resume continues the checkpoint's run as it was set up; "
                               f"drop {', '.join(given)}")
    if parallel is not None:
        raise CommandLineError("--resume runs in one process, not under torchrun")
    from frugal_kernels.lab.train import load_checkpoint

    try:
        return load_checkpoint(args.resume)
    except ValueError as exc:
        raise CommandLineError(f"--resume: {exc}") from None


def _sweep(args: argparse.Namespace) -> int:
    from frugal_kernels.lab import demo, finetune, sweep

    finetuning = args.task == "finetune"
    rows = sweep.rows_of(args.task)
    names = args.optimizers or sweep.default_rows(args.task)
    not_rows = [n for n in names if n not in rows]
    if not_rows:
        raise CommandLineError(f"{', '.join(not_rows)}: not a row of --task {args.task} (its "
                               f"rows: {', '.join(rows)})")
    config = _train_config(args, finetune.DEFAULTS if finetuning else demo.DEFAULTS)
    if args.write_tuned is not None:
        _check_tuned_path(args.write_tuned)
    out = _out(args, "sweep")
    data = None if finetuning else _load_data(config)
    print(f"frugal-kernels sweep --task {args.task}: the {config.model} model"
          + (f" pretrained for {args.base_steps} steps (cached under {args.base_cache}), "
             f"fine-tuned on {config.data or 'the test modules'}" if finetuning else "")
          + f", {config.steps} steps of {config.batch_size}x{config.seq_len} tokens, on "
          f"{config.device}: {len(args.lrs)} lrs x {len(args.matrix_lr_ratios)} matrix lr "
          f"ratios x {len(args.seeds)} seeds for each of {', '.join(names)}")
    try:
        result = sweep.run_sweep(config, names, args.lrs, args.matrix_lr_ratios, args.seeds,
                                 out=out, progress=_progress(args), tuned=args.write_tuned,
                                 data=data, overwrite=True, task=args.task,
                                 base_steps=args.base_steps, cache=args.base_cache,
                                 rebuild_base=args.rebuild_base)
    except (ValueError, OSError) as exc:  # a governed run named, fine-tuning data refused
        raise CommandLineError(str(exc)) from None
    print()
    print(sweep.table(result))
    print("wrote " + ", ".join(result["files"]))
    return 0


def _check_tuned_path(path: Path) -> None:
    """--write-tuned names a file that can be written (its folder exists), checked before the
    sweep trains."""
    path = Path(path)
    if path.is_dir():
        raise CommandLineError(f"--write-tuned {str(path)!r} is a folder, not a file")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK) \
            or (path.exists() and not os.access(path, os.W_OK)):
        raise CommandLineError(f"--write-tuned {str(path)!r} cannot be written (no writable "
                               "folder there)")


def _add_base_arguments(parser: argparse.ArgumentParser, steps: Optional[int]) -> None:
    """The fine-tuning task's base model: its pretraining steps, its cache, a rebuild."""
    from frugal_kernels.lab import finetune

    parser.add_argument("--base-steps", type=_positive_int, default=steps,
                        help=f"--task finetune: steps of the base's pretraining with AdamW "
                             f"(default: {finetune.BASE_STEPS})")
    parser.add_argument("--base-cache", type=Path, default=Path("runs/finetune-base"),
                        help="--task finetune: folder of the cached bases, one per hash of "
                             "their settings (default: runs/finetune-base)")
    parser.add_argument("--rebuild-base", action="store_true",
                        help="--task finetune: pretrain the base again even if cached")


def _add_training_arguments(parser: argparse.ArgumentParser, defaults,
                            swept: bool = False) -> None:
    """The options of a training run; ``swept`` leaves out those a sweep takes lists of
    (--lr, --matrix-lr-ratio, --seed)."""
    from frugal_kernels.data import POLICIES
    from frugal_kernels.model import PRESETS

    add = parser.add_argument
    add("--model", choices=sorted(PRESETS),
        help=f"model preset (default: {defaults.model}); tiny and small suit a CPU, 20m, 60m "
             "and 130m (the FRUGAL paper's LLaMA shapes, here with the 256-byte vocabulary) "
             "want a GPU")
    add("--steps", type=_positive_int, help=f"optimizer steps (default: {defaults.steps})")
    add("--batch-size", type=_positive_int, help=f"sequences per step (default: {defaults.batch_size})")
    add("--seq-len", type=_number(int, "an integer >= 2", lambda v: v >= 2), help=f"bytes per sequence (default: {defaults.seq_len})")
    if not swept:
        add("--lr", type=_positive_float,
            help=f"peak learning rate of the embeddings, norms and head, for every optimizer "
                 f"(default: the demo's tuned lr of each optimizer, else {defaults.lr:g})")
        add("--matrix-lr-ratio", type=_positive_float,
            help=f"the projected matrices' lr over --lr, for every optimizer (default: the "
                 f"demo's tuned ratio, else {defaults.matrix_lr_ratio:g})")
    add("--warmup-steps", type=_non_negative_int,
        help=f"linear warmup before the schedule (default: {defaults.warmup_steps}, "
             "scaled with --steps)")
    add("--schedule", choices=["wsd", "cosine"],
        help=f"lr after the warmup: wsd holds it and decays linearly over the last "
             f"{defaults.cooldown_fraction * 100:.0f}%% of the steps, cosine decays all along "
             f"(default: {defaults.schedule})")
    add("--eval-every", type=_positive_int,
        help=f"steps between validation passes (default: {defaults.eval_every}, scaled with "
             "--steps)")
    add("--eval-batches", type=_positive_int,
        help=f"fixed validation batches per pass (default: {defaults.eval_batches})")
    add("--grad-clip", type=_positive_float,
        help=f"clip the gradient norm to this (default: {defaults.grad_clip:g})")
    add("--no-grad-clip", action="store_true", help="do not clip gradients")
    add("--weight-decay", type=_non_negative_float,
        help=f"decoupled weight decay (default: {defaults.weight_decay:g})")
    if not swept:
        add("--seed", type=_seed, help=f"seed of the initial weights and the batches (default: "
                                     f"{defaults.seed})")
    add("--device", default="auto", type=_device_name,
        help="cpu, cuda, cuda:N or auto (default: a GPU if any)")
    add("--data", type=_data_path, help="a text file or a folder of .txt/.md/.py files to train on (default: the "
                       "Python standard library's sources, already on this machine); "
                       "hf:NAME[:CONFIG] streams a Hugging Face dataset (needs `datasets`; "
                       "downloads)")
    add("--max-bytes", type=_positive_int,
        help=f"read at most this many bytes of data (default: {defaults.max_bytes:,})")
    add("--finetune-bytes", type=_positive_int,
        help="--task finetune: read at most this many bytes of the fine-tuning domain (a "
             "small set trained on for several epochs, where the validation loss plateaus; "
             "default: --max-bytes); the base's data is not changed")
    add("--data-noise", type=_number(float, "a number in [0, 1)", lambda v: 0 <= v < 1),
        metavar="F", help="replace this fraction of the training documents with low-value "
                          "text (their bytes shuffled, or exact duplicates of others), the "
                          "setting where data selection is said to pay (default: 0)")
    add("--select", choices=list(POLICIES),
        help="online data selection: score candidate batches and train on those this policy "
             "keeps: the highest loss, el2n, or rho (loss minus a small reference model's), "
             "the middle losses (middle), the most plausible under a byte-bigram model of "
             "held-out batches (ngram: no forward pass), or a random choice (random, the "
             "control); the scoring FLOPs are counted (default: none)")
    add("--keep", type=_number(float, "a number in (0, 1]", lambda v: 0 < v <= 1),
        help=f"with --select, the fraction of the candidates trained on (default: "
             f"{defaults.keep:g})")
    add("--candidates", type=_positive_int,
        help=f"with --select, batches scored per step (default: {defaults.candidates})")
    add("--badam-switch-every", type=_positive_int, metavar="K",
        help=f"the BAdam rows' steps per block before the next block trains (default: "
             f"{defaults.badam_switch_every})")
    add("--select-reference-steps", type=_positive_int,
        help=f"with --select rho or ngram, the batches of the training split (another seed) "
             f"the reference model trains on, or the bigram counts "
             f"(default: {defaults.select_reference_steps})")
    add("--select-reference-model", choices=sorted(PRESETS),
        help=f"with --select rho, the reference model's preset "
             f"(default: {defaults.select_reference_model})")
    add("--out", type=Path, help="output folder (default: runs/<command>-<date>-<time>); one "
                                 "that holds results of an earlier run is left alone and a "
                                 "new one beside it (<out>-2, ...) is used, unless --overwrite")
    add("--overwrite", action="store_true",
        help="replace the results of an earlier run in --out")
    add("--no-progress", action="store_true",
        help="no progress bars: one line per evaluation on stderr (the default off a terminal)")
    add("--quiet", action="store_true", help="no progress output, only the final table")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="frugal-kernels",
        description="Memory-frugal LLM training: FRUGAL-family optimizers on fused kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    from frugal_kernels.lab import demo
    from frugal_kernels.lab.train import TrainConfig

    demo_parser = sub.add_parser(
        "demo", help="train one model with AdamW, FRUGAL, AdaFRUGAL and their peers and "
                     "compare them",
        description="Train the same model from the same initialisation on the same batches "
                    "with each optimizer (by default AdamW, FRUGAL rho=0.25, AdaFRUGAL, "
                    "AdaFRUGAL under the compute governor with the full run's FLOPs as budget, "
                    "BAdam, DQT 4-bit alone and with FRUGAL, and the peers whose package is "
                    "installed: GaLore, APOLLO, "
                    "Adam-mini, 8-bit AdamW), each at its learning rates from the package's "
                    "tuned.json, then print a table of validation loss, held memory, optimizer "
                    "state, peak memory and step time, and write metrics.json, table.md, "
                    "table.csv and demo.png. The defaults take about 5 minutes on a 2-core CPU.")
    from frugal_kernels.lab import finetune

    finetune_only = [n for n in finetune.ROWS if n not in demo.OPTIMIZERS]
    demo_parser.add_argument(
        "--task", choices=["pretrain", "finetune"], default="pretrain",
        help="pretrain (default): every run trains the same fresh model; finetune: a base "
             "pretrained on the standard library without its tests (cached under "
             "--base-cache) is fine-tuned by every run on the test modules or on --data, "
             "and the table adds each run's loss on the base's own domain (forgetting) and "
             "the governed runs' FLOPs against their twins")
    demo_parser.add_argument(
        "--optimizers", nargs="+", metavar="NAME",
        type=_choice(list(demo.OPTIMIZERS) + finetune_only),
        help=f"runs to compare, from {', '.join(demo.OPTIMIZERS)}, and with --task finetune "
             f"{', '.join(finetune_only)} (default: {', '.join(demo.DEFAULT_RUNS)}; with "
             f"--task finetune {', '.join(finetune.DEFAULT_RUNS)}; those whose package is "
             "installed); a governed run brings the run its budget comes from, a +select "
             "row its twin without selection")
    _add_base_arguments(demo_parser, finetune.BASE_STEPS)
    _add_training_arguments(demo_parser, demo.DEFAULTS)
    demo_parser.add_argument(
        "--select-at-equal-steps", action="store_true",
        help="the +select rows take as many steps as their twins without selection (default: "
             "as many as spend the twin's FLOPs, scoring counted)")
    demo_parser.set_defaults(func=_demo)

    train_defaults = TrainConfig()
    train_parser = sub.add_parser(
        "train", help="train the model with one optimizer, optionally under a FLOP budget",
        description="Train a LLaMA-style model with one optimizer and write every per-step "
                    "metric to metrics.json with a plot. With --flop-budget the run is governed: "
                    "the compute governor sees each validation loss, may reallocate (grow "
                    "AdaFRUGAL's T, shrink its rho) and stops the run when the rest of the "
                    "budget is not worth spending; without --steps the run is as long as the "
                    "budget pays for.")
    trainable = [n for n, entry in demo.OPTIMIZERS.items() if entry.budget_from is None]
    trainable += [n for n, entry in finetune.ROWS.items()
                  if entry.budget_from is None and n not in trainable]
    train_parser.add_argument("--optimizer", type=_choice(trainable),
                              help="the optimizer (default: adafrugal); lora with --task "
                                   "finetune only")
    train_parser.add_argument(
        "--task", choices=["pretrain", "finetune"],
        help="pretrain (default): train a fresh model; finetune: fine-tune the base of demo "
             "--task finetune (pretrained once and cached under --base-cache) on the "
             "standard library's test modules or on --data, at the row's tuned lrs for the task "
             "(tuned.json) where a fine-tuning sweep recorded them, else lr 1e-3")
    # None: the resumed run's, else finetune.BASE_STEPS.
    _add_base_arguments(train_parser, None)
    train_parser.add_argument("--resume", metavar="CHECKPOINT",
                              type=lambda t: _existing_file(t, "--resume"),
                              help="continue the run whose checkpoint.pt (written at every "
                                   "evaluation) this is, exactly where it stopped, with its "
                                   "settings; writes into the checkpoint's folder unless --out")
    train_parser.add_argument("--log", choices=["tensorboard", "wandb"],
                              help="also send the metrics to TensorBoard (event files in "
                                   "<out>/tensorboard) or Weights & Biases (needs the package)")
    train_parser.add_argument("--flop-budget", type=_positive_float, metavar="F",
                              help="total FLOPs the run may spend (model and optimizer)")
    train_parser.add_argument("--governor-window",
                              type=_number(int, "an integer >= 2", lambda v: v >= 2),
                              help="evaluations the governor fits the loss slope on (default 5)")
    train_parser.add_argument("--governor-patience", type=_positive_int,
                              help="evaluations under the threshold before a stop (default 5)")
    train_parser.add_argument("--governor-min-improvement", type=_non_negative_float,
                              help="relative loss improvement under which the rest of the "
                                   "budget is not worth spending (default 0.005)")
    train_parser.add_argument("--governor-select-trial",
                              type=_number(int, "an integer >= 2", lambda v: v >= 2),
                              metavar="K",
                              help="with --select and --flop-budget, let the governor turn "
                                   "selection on and off from trials of K evaluations a mode "
                                   "(docs/governor.md)")
    train_parser.add_argument("--save-model", action="store_true",
                              help="also write the trained weights to model.pt")
    train_parser.add_argument("--fsdp", action="store_true",
                              help="under torchrun, shard the model with FSDP2 (fully_shard: "
                                   "each rank holds its rows of the weights and of the "
                                   "optimizer state); without it a torchrun launch is DDP. "
                                   "--batch-size is the global batch")
    _add_training_arguments(train_parser, train_defaults)
    train_parser.set_defaults(func=_train)

    sweep_parser = sub.add_parser(
        "sweep", help="train the demo's runs over a grid of learning rates, matrix lr ratios "
                      "and seeds",
        description="Train each optimizer at every lr, matrix lr ratio and seed with the "
                    "demo's settings (--task finetune: the fine-tuning demo's, from its one "
                    "cached base), then print and write (sweep.md, .csv, .json) the mean "
                    "final validation loss of each setting, the best per optimizer and the "
                    "seed-to-seed spread there. --write-tuned records the best settings for "
                    "the task in the tuned.json the demo and train read.")
    from frugal_kernels.lab import sweep

    sweepable = [n for n, entry in demo.OPTIMIZERS.items() if entry.budget_from is None]
    sweepable += [n for n, entry in finetune.ROWS.items()
                  if entry.budget_from is None and n not in sweepable]
    sweep_parser.add_argument(
        "--task", choices=["pretrain", "finetune"], default="pretrain",
        help="pretrain (default): the demo's runs, each from a fresh model; finetune: the "
             "runs of demo --task finetune, each from its base (pretrained once at the "
             "default seed and cached under --base-cache; the seeds draw the fine-tuning "
             "batches)")
    sweep_parser.add_argument("--optimizers", nargs="+", metavar="NAME",
                              type=_choice(sweepable),
                              help=f"rows of the task, from {', '.join(sweepable)} (lora with "
                                   f"--task finetune only; default: the task's default rows "
                                   f"but the governed ones and frugal+inbwd, which take "
                                   f"another row's tuning: "
                                   f"{', '.join(sweep.default_rows('pretrain'))}; with --task "
                                   f"finetune {', '.join(sweep.default_rows('finetune'))}; "
                                   f"those whose package is installed)")
    sweep_parser.add_argument("--lrs", nargs="+", type=_positive_float, required=True,
                              metavar="LR", help="learning rates of the embeddings, norms and "
                                                 "head")
    sweep_parser.add_argument("--matrix-lr-ratios", "--matrix-lr-ratio", nargs="+",
                              type=_positive_float, metavar="R", dest="matrix_lr_ratios",
                              default=list(sweep.MATRIX_LR_RATIOS),
                              help="the matrices' lr over the lr (default: "
                                   f"{' '.join(f'{r:g}' for r in sweep.MATRIX_LR_RATIOS)})")
    sweep_parser.add_argument("--seeds", nargs="+", type=_seed, default=[0, 1], metavar="S",
                              help="seeds of the initial weights and batches (default: 0 1)")
    _add_base_arguments(sweep_parser, finetune.BASE_STEPS)
    from frugal_kernels.lab import tuned

    sweep_parser.add_argument("--write-tuned", nargs="?", type=Path, const=tuned.PATH,
                              metavar="PATH",
                              help=f"record the best settings for the task in PATH (default: "
                                   f"the package's {tuned.PATH.name}, which the demo and "
                                   f"train read)")
    _add_training_arguments(sweep_parser, demo.DEFAULTS, swept=True)
    sweep_parser.set_defaults(func=_sweep)

    bench = sub.add_parser(
        "bench", help="time the fused ops and optimizer steps on this machine",
        description="Time every fused op (per backend, dtype and size) against a copy-bandwidth "
                    "baseline and torch.optim.AdamW(fused=True), and whole optimizer steps on a "
                    "LLaMA-shaped parameter set, all measured side by side in one run. Writes "
                    "<out>/<stem>.json, .md and .png after each section.")
    bench.add_argument("--device", default="auto", type=_device_name,
                       help="cpu, cuda or auto (default)")
    bench.add_argument("--quick", action="store_true", help="a short run (a minute or two on a CPU)")
    bench.add_argument("--out", type=Path, default=Path("bench/results"),
                       help="folder for the results (default: bench/results)")
    from frugal_kernels.bench import SECTIONS as bench_sections
    from frugal_kernels.bench.ops import OP_NAMES
    from frugal_kernels.model import PRESETS

    bench.add_argument("--ops", nargs="+", metavar="OP", choices=OP_NAMES,
                       help=f"only these ops, from {', '.join(OP_NAMES)}")
    bench.add_argument("--dtypes", nargs="+", metavar="DTYPE", choices=("float32", "bfloat16", "float16"),
                       help="parameter dtypes of the op sweep, from float32, bfloat16, float16 "
                            "(default float32 with --quick, else float32 and bfloat16)")
    bench.add_argument("--no-ops", action="store_true", help="skip the op sweep")
    bench.add_argument("--no-optimizers", action="store_true", help="skip the optimizer steps")
    bench.add_argument("--no-overhead", action="store_true",
                       help="skip the host-overhead steps (skipped on a GPU unless --only "
                            "names them)")
    bench.add_argument("--no-in-backward", action="store_true",
                       help="skip the step-memory comparison, ordinary vs step in backward")
    bench.add_argument("--only", nargs="+", metavar="SECTION", choices=bench_sections,
                       help="run only these sections: ops, optimizers, overhead (the host time "
                            "per step on LLaMA-130M's tensor structure with tiny tensors), "
                            "in_backward (the memory of a LLaMA-20m training step, ordinary "
                            "vs frugal_kernels.step_in_backward), dqt (QuantLinear storage, "
                            "a whole training step of one layer, and on a GPU its forward "
                            "with the fused dequantize-matmul against nn.Linear), loss (peak "
                            "memory and time of ops.linear_cross_entropy against the unfused "
                            "F.cross_entropy(hidden @ weight.T))")
    bench.add_argument("--preset", choices=sorted(PRESETS),
                       help="model shape of the optimizer part (default 130m, 20m with --quick) "
                            "and of the in_backward part (default 20m)")
    bench.add_argument("--rounds", type=_positive_int, help="timing rounds per candidate")
    bench.add_argument("--stem", help="file name of the results without extension (default: "
                                      "the device id, then -quick and the --only sections)")
    fresh = bench.add_mutually_exclusive_group()
    fresh.add_argument("--fresh-processes", dest="fresh_processes", action="store_true",
                       default=None,
                       help="measure each in_backward row in a fresh process (default on a CPU, "
                            "where the figure is the process's resident memory)")
    fresh.add_argument("--in-process", dest="fresh_processes", action="store_false",
                       help="measure every in_backward row in this process (default on a GPU, "
                            "where the allocator's count is reset per row)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        # A bare `frugal-kernels`: what it can do, rather than "command is required".
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CommandLineError as exc:
        print(f"{parser.prog} {args.command}: error: {exc} (see {parser.prog} {args.command} "
              "--help)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        # Ctrl-C: what finished is written (the message says where), no traceback; 130 is
        # the shell's status for a process stopped by SIGINT.
        message = getattr(exc, "message", "") or "nothing written"
        print(f"\n{parser.prog} {args.command}: interrupted: {message}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
