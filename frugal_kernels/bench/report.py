"""Writing benchmark results: JSON, a markdown table and a PNG chart."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

from frugal_kernels.bench import loss as _loss


def _fmt_numel(n: int) -> str:
    return f"{n / 2**20:g}M" if n >= 2**20 else f"{n / 2**10:g}K"


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    """A markdown table, then a blank line."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _op_key(row: dict) -> str:
    """Which recorded rows a measured op row is compared with (any size)."""
    return f"{row['op']}[{row['variant']}]/{row['backend']}/{row['dtype']}"


def recorded_ranges(out_dir: Path, device_id: str) -> dict:
    """The lowest and highest ``x fused AdamW`` ratio of each op (``_op_key``) in the
    results recorded for this machine class (``<device_id>.json`` and its ``-quick``
    run, as found before this run writes its own): what a new measurement is held to."""
    ranges: dict = {}
    for stem in (device_id, f"{device_id}-quick"):
        path = Path(out_dir) / f"{stem}.json"
        try:
            rows = json.loads(path.read_text()).get("ops") or []
        except (OSError, ValueError):
            continue
        for row in rows:
            ratio = row.get("speedup_vs_torch_adamw_fused")
            if ratio is None:
                continue
            lo, hi = ranges.get(_op_key(row), (ratio, ratio))
            ranges[_op_key(row)] = (min(lo, ratio), max(hi, ratio))
    return {key: list(r) for key, r in ranges.items()}


def _load_line(fp: dict) -> List[str]:
    """The machine's load when the run began, and what it means for the ratios."""
    load, cpus = fp.get("load_average"), fp.get("logical_cpus")
    if not load or not cpus:
        return []
    busy = load[0] > 0.5 * cpus
    return [f"Load: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min) on {cpus} "
            f"logical CPUs when the run began" + (
                ": the machine was busy, so every ratio below is noisier than on an idle "
                "one; compare the spread beside it" if busy else "."), ""]


def _ratio_cell(row: dict, recorded: dict) -> str:
    """The ratio, the interquartile range of its per-round values, and a flag when it lies
    outside the range recorded for this machine class."""
    ratio = row["speedup_vs_torch_adamw_fused"]
    cell = f"{ratio:.2f}"
    spread = row.get("speedup_spread")
    if spread:
        cell += f" ({spread[0]:.2f}-{spread[1]:.2f})"
    known = recorded.get(_op_key(row))
    if known and not known[0] <= ratio <= known[1]:
        cell += (f" **outside the recorded {known[0]:.2f}-{known[1]:.2f}: noise or "
                 "regression**")
    return cell


def markdown(result: dict) -> str:
    fp = result["fingerprint"]
    where = fp.get("gpu") or f"{fp['cpu']} ({fp['cpu_isa']}, {fp['threads']} threads)"
    lines = [f"# frugal_kernels benchmark: {where}", "",
             f"torch {fp['torch']}, triton {fp['triton']}, frugal_kernels {fp['frugal_kernels']}; "
             f"command: `{result['command']}`", ""] + _load_line(fp)
    seconds = result.get("section_seconds")
    if seconds:
        lines += ["Seconds per section: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items())
                  + ("" if result.get("complete", True) else
                     " (the run has not finished: later sections are missing)"), ""]
    ops = result.get("ops") or []
    if ops:
        lines += ["## Fused ops", "",
                  "Bandwidth is the bytes each op must move over its median time (byte model in "
                  "docs/benchmarks.md). The roofline is an in-place `a.add_(b)` over as many fp32 "
                  "values as there are parameters (12 B each: two reads, one write); a plain "
                  "copy (8 B counted, plus the write-allocate it does not count) is beside it. "
                  "Both, and torch.optim.AdamW(fused=True) on the same tensors, ran in the same "
                  "rounds. x fused AdamW: the median ratio, with in brackets the interquartile "
                  "range of its value round by round; a ratio outside the range recorded for "
                  "this machine class (bench/results) is flagged: on a busy machine that is "
                  "most likely noise, on an idle one a regression.", ""]
        recorded = result.get("recorded_ranges") or {}
        lines += _table(
            ["op", "variant", "backend", "dtype", "params", "ms", "GB/s", "of roofline", "of copy",
             "x fused AdamW"],
            [[r["op"], r["variant"] or "-", r["backend"], r["dtype"], _fmt_numel(r["numel"]),
              f"{r['seconds'] * 1e3:.2f}", f"{r['gbps']:.1f}", f"{r['roofline_fraction']:.0%}",
              f"{r['copy_fraction']:.0%}", _ratio_cell(r, recorded)]
             for r in ops])
    opt = result.get("optimizers")
    if opt:
        lines += [f"## Optimizer state on the {opt['preset']} parameter set "
                  f"({opt['num_params'] / 1e6:.1f}M params)", ""]
        lines += _table(["optimizer", "state MB", "bytes/param"],
                        [[r["optimizer"], f"{r['state_mb']:.1f}", f"{r['bytes_per_param']:.2f}"]
                         for r in opt["state"]])
        speedup = opt["step"]["speedup_vs_torch_adamw_fused"]
        lines += ["## Optimizer step time", ""]
        lines += _table(["optimizer", "ms/step", "x fused AdamW"],
                        [[name, f"{t * 1e3:.1f}", f"{speedup[name]:.2f}"]
                         for name, t in opt["step"]["seconds"].items()])
    over = result.get("overhead")
    if over:
        lines += [f"## Host time per step ({over['preset']} tensor structure: {over['tensors']} "
                  f"tensors of {over['numel']:,} elements in all, {over['threads']} thread)", "",
                  f"torch.optim.AdamW(fused=True): {over['torch_adamw_fused_us']:.0f} us per "
                  "step, in the same rounds. A change: what a step that chooses the subspace "
                  "again costs on top of a steady one.", ""]
        lines += _table(["optimizer", "us/step", "x fused AdamW", "change, us"],
                        [[r["optimizer"], f"{r['step_us']:.0f}", f"{r['vs_torch_adamw_fused']:.2f}",
                          "-" if r["change_us"] is None else f"{r['change_us']:.0f}"]
                         for r in over["rows"]])
    lines += _in_backward_lines(result.get("in_backward"))
    dqt = result.get("dqt")
    if dqt:
        step = dqt["step"]
        lines += [f"## DQT: one {step['dim']} x {step['dim']} layer", "",
                  "Bytes per weight of the stored weight (codes and scales, or the float "
                  "weight), from the tensors' storages:", ""]
        lines += _table(["format", "bytes/weight"],
                        [[r["format"], f"{r['bytes_per_weight']:.3f}"] for r in dqt["storage"]])
        lines += ["", f"A whole training step (forward, backward, optimizer step) at batch "
                      f"{step['batch']}, in the same rounds:", ""]
        lines += _table(["layer + optimizer", "ms/step", "x nn.Linear fp32 + fused AdamW"],
                        [[name, f"{t * 1e3:.1f}", f"{step['vs_linear_adamw'][name]:.2f}"]
                         for name, t in step["seconds"].items()])
        lines += _dqt_forward_lines(dqt.get("forward"))
    lines += _loss.markdown_lines(result.get("loss"))
    lines += _clip_lines(result.get("clip"))
    return "\n".join(lines)


def _clip_lines(clip: Optional[dict]) -> List[str]:
    if not clip:
        return []
    lines = ["## The default step, and clip + step, against torch's", "",
             "*step*: the optimizer's step with its defaults (`nonfinite=\"skip\"`) against "
             "`torch.optim.AdamW(fused=True)`; *clip + step*: `opt.clip_grad_norm_(1.0); "
             "opt.step()` against `torch.nn.utils.clip_grad_norm_(params, 1.0)` + fused "
             "AdamW's step. Ratios above 1 are faster than torch; all in the same rounds.", ""]
    for name, part in clip.items():
        lines += [f"### {name} ({_fmt_numel(part['numel'])} params): torch fused AdamW "
                  f"{part['torch_adamw_fused_ms']:.1f} ms, torch clip + fused AdamW "
                  f"{part['torch_clip_adamw_fused_ms']:.1f} ms", ""]
        lines += _table(["optimizer", "step ms", "x fused AdamW", "clip + step ms",
                         "x torch clip + fused AdamW"],
                        [[r["optimizer"], f"{r['step_ms']:.1f}", f"{r['step_vs_fused_adamw']:.2f}",
                          f"{r['clip_step_ms']:.1f}" if "clip_step_ms" in r else "-",
                          f"{r['clip_step_vs_torch']:.2f}" if "clip_step_vs_torch" in r else "-"]
                         for r in part["rows"]])
    return lines


def _dqt_forward_lines(fwd: Optional[dict]) -> List[str]:
    """The forward table of frugal_kernels.bench.dqt.forward, or the reason it was skipped."""
    if not fwd:
        return []
    if "skipped" in fwd:
        return ["", f"Forward with the fused dequantize-matmul (quant_matmul): skipped, "
                    f"{fwd['skipped']}."]
    lines = ["", f"Forward pass of one {fwd['dim']} x {fwd['dim']} layer, QuantLinear "
                 f"{fwd['bits']}-bit (row scales, fused dequantize-matmul) against nn.Linear "
                 "of the input's dtype, in the same rounds:", ""]
    return lines + _table(["dtype", "batch", "nn.Linear ms", "QuantLinear ms", "x nn.Linear"],
                          [[r["dtype"], str(r["batch"]), f"{r['linear_s'] * 1e3:.3f}",
                            f"{r['quant_s'] * 1e3:.3f}", f"{r['vs_linear']:.2f}"]
                           for r in fwd["rows"]])


def _in_backward_lines(ib: Optional[dict]) -> List[str]:
    """The step-memory tables of frugal_kernels.bench.in_backward, one per shape."""
    if not ib or not ib["rows"]:
        return []
    mb = 2**20
    first = ib["rows"][0]
    cuda = first["peak_kind"] == "cuda_max_allocated"
    peak = "max allocated MB" if cuda else "process peak MB"
    lines = [f"## Memory of a training step, ordinary vs step in backward ({ib['preset']}: "
             f"{first['num_params'] / 1e6:.1f}M params)", "",
             "held: the most bytes of parameters + gradients + optimizer state alive at once "
             "during one whole step (forward, backward, step), each storage counted once, "
             "sampled at the end of forward, at every gradient's completion, after backward "
             "and after the step; + activations: the same with the tensors autograd saved "
             "for backward. "
             + ("max allocated: torch.cuda.max_memory_allocated over the step." if cuda else
                "process peak: the resident-memory high-water mark (VmHWM) during the step; "
                "at start: the resident memory when it began (torch, the model, the state)"
                + ("; each configuration in a fresh process" if ib["fresh_processes"] else "")
                + ". The process figures move by about 20 MB between runs (the allocator), "
                "the held bytes do not."), ""]
    shapes = sorted({(r["batch_size"], r["seq_len"]) for r in ib["rows"]})
    for batch_size, seq_len in shapes:
        rows = [r for r in ib["rows"] if (r["batch_size"], r["seq_len"]) == (batch_size, seq_len)]
        lines += [f"### {batch_size} x {seq_len} tokens", ""]
        lines += _table(
            ["optimizer", "step", "held MB", "params / grads / state MB", "x ordinary AdamW",
             "+ activations MB", peak, "at start MB", "above start MB"],
            [[r["label"], r["mode"].replace("_", " "), f"{r['held_bytes'] / mb:.1f}",
              " / ".join(f"{r['held_parts'][k] / mb:.1f}" for k in ("params", "grads", "state")),
              f"{r['held_vs_torch_adamw']:.3f}" if r["held_vs_torch_adamw"] else "-",
              f"{r['held_with_activations_bytes'] / mb:.1f}", f"{r['memory_peak'] / mb:.0f}",
              f"{r['memory_at_start'] / mb:.0f}", f"{r['peak_above_start'] / mb:.0f}"]
             for r in rows])
    for v in ib.get("target") or []:
        lines.append(f"At {v['batch_size']} x {v['seq_len']}: FRUGAL rho=0.25 in backward "
                     f"holds {v['ratio']:.3f}x the held bytes of ordinary torch AdamW.")
    return lines + [""]


def plot(result: dict, path: Path) -> Optional[Path]:
    """Bars of each op's fraction of copy bandwidth and of each optimizer's
    speed against fused AdamW; None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ops = result.get("ops") or []
    opt = result.get("optimizers")
    panels = int(bool(ops)) + int(bool(opt))
    if panels == 0:
        return None
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 5), squeeze=False)
    axes = list(axes[0])
    if ops:
        ax = axes.pop(0)
        largest = max(r["numel"] for r in ops)
        rows = [r for r in ops if r["numel"] == largest]
        labels = [f"{r['op']}{'[' + r['variant'] + ']' if r['variant'] else ''}\n"
                  f"{r['backend']} {r['dtype']}" for r in rows]
        ax.bar(range(len(rows)), [r["roofline_fraction"] for r in rows], color="tab:blue")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
        ax.set_ylabel("effective bandwidth / in-place a.add_(b) bandwidth")
        ax.set_title(f"fused ops, {_fmt_numel(largest)} params")
    if opt:
        ax = axes.pop(0)
        speed = opt["step"]["speedup_vs_torch_adamw_fused"]
        ax.barh(list(speed), list(speed.values()), color="tab:green")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("step speed / torch.optim.AdamW(fused=True)")
        ax.set_title(f"optimizer step, {opt['preset']} parameter set")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def files(out_dir: Path, stem: str) -> List[Path]:
    """The JSON and markdown files :func:`write` writes (a PNG beside them where
    matplotlib is installed)."""
    return [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so that a run
    killed while writing leaves the previous complete file, never half of one."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def write(result: dict, out_dir: Path, stem: str) -> List[Path]:
    """Write (or rewrite) ``<out_dir>/<stem>.{json,md,png}`` from ``result``; called after
    each section of a run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = files(out_dir, stem)
    _replace(paths[0], json.dumps(result, indent=1))
    _replace(paths[1], markdown(result))
    png = plot(result, out_dir / f"{stem}.png")
    if png is not None:
        paths.append(png)
    return paths
