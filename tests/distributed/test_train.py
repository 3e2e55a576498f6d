"""``frugal-kernels train`` under torchrun: two CPU ranks (gloo), FSDP2 with --fsdp and DDP
without, against the same run in one process.

Each rank takes half of every global batch, so the run is the one-process run but for
the rounding of the gradients' reduction: the validation losses agree to a few digits,
and FSDP2's optimizer state per rank is about half of the one-process figure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from frugal_kernels.lab import demo
from frugal_kernels.lab.train import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 200_000
ARGS = ["--model", "tiny", "--steps", "6", "--batch-size", "4", "--seq-len", "16",
        "--eval-every", "3", "--eval-batches", "1", "--max-bytes", str(MAX_BYTES),
        "--device", "cpu", "--no-progress"]
# What the command line above makes of the defaults (--steps scales the warmup).
CONFIG = dataclasses.replace(TrainConfig().with_steps(6, eval_every=3), model="tiny",
                             batch_size=4, seq_len=16, eval_batches=1, max_bytes=MAX_BYTES)


def torchrun(tmp_path: Path, *args: str) -> dict:
    # A rank that dies on a signal prints every thread's Python stack.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", "-m", "frugal_kernels", "train", *args,
                           *ARGS, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("mode, optimizer", [("fsdp", "adafrugal"), ("ddp", "frugal")])
def test_train_under_torchrun_matches_one_process(tmp_path, mode, optimizer):
    flags = ["--fsdp"] if mode == "fsdp" else []
    metrics = torchrun(tmp_path, *flags, "--optimizer", optimizer)
    two = metrics["runs"][optimizer]
    assert metrics["config"]["parallel"] == mode
    one = demo.run_train(demo.run_config(CONFIG, optimizer), optimizer, out=tmp_path / "one",
                         progress=False)["runs"][optimizer]
    assert [e["step"] for e in two["evaluations"]] == [3, 6]
    for a, b in zip(two["evaluations"], one["evaluations"]):
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-3
    if mode == "fsdp":
        # The ranks step their own rows: the optimizer's FLOPs add up to one process's.
        assert two["summary"]["flops"] == pytest.approx(one["summary"]["flops"])
    else:
        # Each DDP rank steps every parameter: the optimizer's FLOPs are spent twice.
        assert one["summary"]["flops"] < two["summary"]["flops"] < 1.1 * one["summary"]["flops"]
    # AdaFRUGAL's schedule followed the same (averaged) losses on both ranks.
    assert two["optimizer_history"] == one["optimizer_history"]
    state = two["summary"]["state_bytes"] / one["summary"]["state_bytes"]
    if mode == "fsdp":
        # The first rank's share: its rows of every moment.
        assert 0.4 < state < 0.6, state
    else:
        assert state == 1.0
