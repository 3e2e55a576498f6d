"""What machine a result was measured on."""

from __future__ import annotations

import os
import platform
import re
from typing import Optional

import torch

import frugal_kernels


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> Optional[str]:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def fingerprint(device: torch.device) -> dict:
    """CPU model, ISA and threads, or GPU name, compute capability, driver and
    memory; with the versions of torch, triton and this package."""
    info = frugal_kernels.build_info()
    fp = {
        "device_type": device.type,
        "cpu": _cpu_model(),
        "cpu_isa": info["cpu_isa"],
        "threads": torch.get_num_threads(),
        "logical_cpus": os.cpu_count(),
        # The 1, 5 and 15 minute load averages when the run began: on a busy machine every
        # ratio is noisier (docs/benchmarks.md).
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "triton": _version("triton"),
        "frugal_kernels": info["version"],
        "extension": info["extension"],
        "cuda_kernels": info["cuda"],
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        fp.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                  gpu_memory_gib=round(props.total_memory / 2**30, 1),
                  cuda_runtime=torch.version.cuda, driver=_nvidia_driver())
    return fp


def _nvidia_driver() -> Optional[str]:
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+([\d.]+)", f.read())
            return m.group(1) if m else None
    except OSError:
        return None


def device_id(fp: dict) -> str:
    """A file-name-safe id of the machine: the GPU, or the CPU and its ISA level."""
    name = fp.get("gpu") if fp["device_type"] == "cuda" else f"{fp['cpu']}-{fp['cpu_isa']}"
    return re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-")
