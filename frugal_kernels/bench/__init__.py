"""``frugal-kernels bench``: how fast the fused ops and optimizer steps are on this machine.

See :func:`run`; results go to ``<out>/<device-id>.{json,md,png}``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from frugal_kernels.bench import dqt as _dqt
from frugal_kernels.bench import fingerprint as _fingerprint
from frugal_kernels.bench import in_backward as _in_backward
from frugal_kernels.bench import loss as _loss
from frugal_kernels.bench import ops as _ops
from frugal_kernels.bench import optimizers as _optimizers
from frugal_kernels.bench import overhead as _overhead
from frugal_kernels.bench import report

__all__ = ["run", "SECTIONS"]

# The parts of a run, as `frugal-kernels bench --only` names them.
SECTIONS = ("ops", "optimizers", "overhead", "in_backward", "dqt", "loss")


def run(*, device: str = "auto", quick: bool = False, out: Optional[Path] = None,
        op_names: Optional[Sequence[str]] = None, with_ops: bool = True,
        with_optimizers: bool = True, with_overhead: bool = True, with_in_backward: bool = True,
        with_dqt: bool = True, with_loss: bool = True,
        preset: Optional[str] = None,
        rounds: Optional[int] = None, dtypes: Optional[Sequence[str]] = None,
        command: str = "") -> dict:
    """Run the benchmark sweep and write its results; returns them as a dict."""
    from tqdm.auto import tqdm

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    fp = _fingerprint.fingerprint(dev)
    result = {"fingerprint": fp, "command": command or " ".join(sys.argv),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": quick}
    rounds = rounds or (5 if quick else 15)
    given_preset = preset
    if with_ops:
        numels = [1 << 22] if quick else [1 << 20, 1 << 24]
        if dev.type == "cuda" and not quick:
            numels.append(1 << 27)
        op_dtypes = ([getattr(torch, name) for name in dtypes] if dtypes else
                     [torch.float32] if quick else [torch.float32, torch.bfloat16])
        with tqdm(total=len(numels) * len(op_dtypes), desc="ops", unit="config") as bar:
            result["ops"] = _ops.sweep(device=dev, numels=numels, dtypes=op_dtypes, rounds=rounds,
                                       op_names=op_names, progress=bar)
    if with_optimizers:
        preset = preset or ("20m" if quick else "130m")
        with tqdm(total=2, desc=f"optimizers ({preset})", unit="part") as bar:
            model = _optimizers.llama_param_set(preset, dev)
            num_params = sum(p.numel() for p in model.parameters())
            state = _optimizers.state_bytes(model)
            bar.update(1)
            steps = _optimizers.step_times(model, rounds=max(3, rounds // 2))
            bar.update(1)
        result["optimizers"] = {"preset": preset, "num_params": num_params, "state": state,
                                "step": steps}
    if with_overhead:
        # The tensor structure of the full-size preset even in a quick run: it is tiny.
        with tqdm(total=1, desc="host overhead (130m structure)", unit="part") as bar:
            result["overhead"] = _overhead.host_overhead("130m", rounds=max(rounds, 15))
            bar.update(1)
    if with_in_backward:
        # LLaMA-20m unless a preset is given, even in a full run: a step's memory is what
        # is measured, and on the CPU a 130m step takes seconds.
        ib_preset = given_preset or "20m"
        # A quick run: the fewest tokens, torch AdamW and FRUGAL rho=0.25 only.
        shapes = _in_backward.SHAPES[:1] if quick else _in_backward.SHAPES
        names = ["torch_adamw", "frugal_rho0.25"] if quick else list(_in_backward.OPTIMIZERS)
        with tqdm(total=len(shapes) * len(names) * 2, unit="run",
                  desc=f"step memory, ordinary vs in backward ({ib_preset})") as bar:
            result["in_backward"] = _in_backward.step_memory(
                ib_preset, names=names, shapes=shapes, device=dev.type, progress=bar)
    if with_dqt:
        # One 4096 x 4096 layer at batch 4 (issue's setting; 1024 in a quick run).
        dim = 1024 if quick else 4096
        with tqdm(total=3, desc=f"dqt ({dim} x {dim} layer)", unit="part") as bar:
            storage = _dqt.storage(dim, dev)
            bar.update(1)
            result["dqt"] = {"storage": storage,
                             "step": _dqt.layer_step(dim, 4, rounds=max(3, rounds // 2),
                                                     device=dev)}
            bar.update(1)
            result["dqt"]["forward"] = _dqt.forward(dim, rounds=rounds, device=dev)
            bar.update(1)
        if "skipped" in result["dqt"]["forward"]:
            print(f"dqt forward (QuantLinear with quant_matmul vs nn.Linear): skipped, "
                  f"{result['dqt']['forward']['skipped']}")
    if with_loss:
        shapes = _loss.shapes_for(dev, quick)
        with tqdm(total=sum(len(v) for _, _, v in shapes), desc="fused linear cross-entropy",
                  unit="shape") as bar:
            result["loss"] = _loss.run(dev, shapes=shapes, rounds=max(3, rounds // 5),
                                       progress=bar)
    out = Path(out) if out is not None else Path("bench/results")
    stem = _fingerprint.device_id(fp) + ("-quick" if quick else "")
    result["files"] = [str(p) for p in report.write(result, out, stem)]
    return result
