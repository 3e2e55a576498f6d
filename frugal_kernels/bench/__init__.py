"""``frugal-kernels bench``: how fast the fused ops and optimizer steps are on this machine.

See :func:`run`; results go to ``<out>/<stem>.{json,md,png}``, rewritten after each
section, so that a run cut short keeps every section that finished.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from frugal_kernels.bench import clip as _clip
from frugal_kernels.bench import dqt as _dqt
from frugal_kernels.bench import fingerprint as _fingerprint
from frugal_kernels.bench import in_backward as _in_backward
from frugal_kernels.bench import loss as _loss
from frugal_kernels.bench import ops as _ops
from frugal_kernels.bench import optimizers as _optimizers
from frugal_kernels.bench import overhead as _overhead
from frugal_kernels.bench import report

__all__ = ["run", "SECTIONS", "default_stem", "device_defaults"]

# The parts of a run, as `frugal-kernels bench --only` names them, in the order they run.
SECTIONS = ("ops", "optimizers", "overhead", "in_backward", "dqt", "clip", "loss")


def default_stem(fingerprint: dict, quick: bool, only: Optional[Sequence[str]] = None) -> str:
    """``<device-id>[-quick][-<section>...]``: runs of different sections get different
    files, so running them apart overwrites nothing."""
    stem = _fingerprint.device_id(fingerprint) + ("-quick" if quick else "")
    if only and set(only) != set(SECTIONS):
        stem += "-" + "-".join(s for s in SECTIONS if s in set(only))
    return stem


def device_defaults(device: torch.device) -> dict:
    """What :func:`run` does by default on ``device``: the host-overhead section and a
    fresh process per step-memory row on a CPU only."""
    on_cpu = device.type == "cpu"
    return {"with_overhead": on_cpu, "fresh_processes": on_cpu}


def run(*, device: str = "auto", quick: bool = False, out: Optional[Path] = None,
        op_names: Optional[Sequence[str]] = None, with_ops: bool = True,
        with_optimizers: bool = True, with_overhead: Optional[bool] = None,
        with_in_backward: bool = True, with_dqt: bool = True, with_clip: bool = True,
        with_loss: bool = True,
        preset: Optional[str] = None,
        rounds: Optional[int] = None, dtypes: Optional[Sequence[str]] = None,
        fresh_processes: Optional[bool] = None, stem: Optional[str] = None,
        only: Optional[Sequence[str]] = None, command: str = "") -> dict:
    """Run the benchmark sweep and write its results; returns them as a dict.

    ``with_overhead`` None: on a CPU only (the section steps CPU tensors whatever the
    device; on a GPU run it would spend the time without a GPU figure). ``fresh_processes``
    None: each step-memory row in a fresh process on a CPU (its figure is the process's
    resident memory), all in this process on a GPU (the allocator's own count, reset per
    row). ``stem`` None: :func:`default_stem` of the device, ``quick`` and ``only``.
    """
    from tqdm.auto import tqdm

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    defaults = device_defaults(dev)
    if with_overhead is None:
        with_overhead = defaults["with_overhead"]
    if fresh_processes is None:
        fresh_processes = defaults["fresh_processes"]
    fp = _fingerprint.fingerprint(dev)
    result = {"fingerprint": fp, "command": command or " ".join(sys.argv),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": quick,
              "section_seconds": {}, "complete": False}
    out = Path(out) if out is not None else Path("bench/results")
    stem = stem or default_stem(fp, quick, only)
    result["files"] = [str(p) for p in report.files(out, stem)]
    # Read before this run writes over them.
    result["recorded_ranges"] = report.recorded_ranges(out, _fingerprint.device_id(fp))
    rounds = rounds or (5 if quick else 15)
    given_preset = preset
    started = time.perf_counter()

    def done(section: str, since: float) -> None:
        """The section's time, then every result so far on disk."""
        seconds = time.perf_counter() - since
        result["section_seconds"][section] = round(seconds, 2)
        print(f"bench: {section} took {seconds:.1f} s "
              f"({time.perf_counter() - started:.1f} s so far)", flush=True)
        report.write(result, out, stem)

    if with_ops:
        since = time.perf_counter()
        numels = [1 << 22] if quick else [1 << 20, 1 << 24]
        if dev.type == "cuda" and not quick:
            numels.append(1 << 27)
        op_dtypes = ([getattr(torch, name) for name in dtypes] if dtypes else
                     [torch.float32] if quick else [torch.float32, torch.bfloat16])
        with tqdm(total=len(numels) * len(op_dtypes), desc="ops", unit="config") as bar:
            result["ops"] = _ops.sweep(device=dev, numels=numels, dtypes=op_dtypes, rounds=rounds,
                                       op_names=op_names, progress=bar)
        done("ops", since)
    if with_optimizers:
        since = time.perf_counter()
        preset = preset or ("20m" if quick else "130m")
        with tqdm(total=2, desc=f"optimizers ({preset})", unit="part") as bar:
            model = _optimizers.llama_param_set(preset, dev)
            num_params = sum(p.numel() for p in model.parameters())
            state = _optimizers.state_bytes(model)
            bar.update(1)
            steps = _optimizers.step_times(model, rounds=max(3, rounds // 2))
            bar.update(1)
        del model
        result["optimizers"] = {"preset": preset, "num_params": num_params, "state": state,
                                "step": steps}
        done("optimizers", since)
    if with_overhead:
        since = time.perf_counter()
        # The tensor structure of the full-size preset even in a quick run: it is tiny.
        with tqdm(total=1, desc="host overhead (130m structure)", unit="part") as bar:
            result["overhead"] = _overhead.host_overhead("130m", rounds=max(rounds, 15))
            bar.update(1)
        done("overhead", since)
    if with_in_backward:
        since = time.perf_counter()
        # LLaMA-20m unless a preset is given, even in a full run: a step's memory is what
        # is measured, and on the CPU a 130m step takes seconds.
        ib_preset = given_preset or "20m"
        # A quick run: the fewest tokens, torch AdamW and FRUGAL rho=0.25 only.
        shapes = _in_backward.SHAPES[:1] if quick else _in_backward.SHAPES
        names = ["torch_adamw", "frugal_rho0.25"] if quick else list(_in_backward.OPTIMIZERS)
        with tqdm(total=len(shapes) * len(names) * 2, unit="run",
                  desc=f"step memory, ordinary vs in backward ({ib_preset})") as bar:
            result["in_backward"] = _in_backward.step_memory(
                ib_preset, names=names, shapes=shapes, device=dev.type,
                fresh_processes=fresh_processes, progress=bar)
        done("in_backward", since)
    if with_dqt:
        since = time.perf_counter()
        # One 4096 x 4096 layer at batch 4 (issue's setting; 1024 in a quick run).
        dim = 1024 if quick else 4096
        with tqdm(total=3, desc=f"dqt ({dim} x {dim} layer)", unit="part") as bar:
            dqt = {"storage": _dqt.storage(dim, dev)}
            bar.update(1)
            dqt["step"] = _dqt.layer_step(dim, 4, rounds=max(3, rounds // 2), device=dev)
            bar.update(1)
            dqt["forward"] = _dqt.forward(dim, rounds=rounds, device=dev)
            bar.update(1)
        result["dqt"] = dqt
        if "skipped" in dqt["forward"]:
            print(f"dqt forward (QuantLinear with quant_matmul vs nn.Linear): skipped, "
                  f"{dqt['forward']['skipped']}")
        done("dqt", since)
    if with_clip:
        since = time.perf_counter()
        # The default step and clip + step against torch's (issue 31): one 4096 x 4096
        # matrix and the LLaMA shapes (20m in a quick run, 130m otherwise).
        clip_preset = given_preset or ("20m" if quick else "130m")
        with tqdm(total=1, desc=f"clip + step ({clip_preset})", unit="part") as bar:
            result["clip"] = _clip.clip_rows(clip_preset, device=dev,
                                             rounds=max(3, rounds // 2))
            bar.update(1)
        done("clip", since)
    if with_loss:
        since = time.perf_counter()
        shapes = _loss.shapes_for(dev, quick)
        with tqdm(total=sum(len(v) for _, _, v in shapes), desc="fused linear cross-entropy",
                  unit="shape") as bar:
            result["loss"] = _loss.run(dev, shapes=shapes, rounds=max(3, rounds // 5),
                                       fresh_processes=fresh_processes, progress=bar)
        done("loss", since)
    result["complete"] = True
    result["files"] = [str(p) for p in report.write(result, out, stem)]
    return result
