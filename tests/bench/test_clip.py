"""The clip section of the benchmark: every row, both parameter sets, and the report's table
(its timings are not asserted)."""

import torch

from frugal_kernels.bench import clip
from frugal_kernels.bench.report import _clip_lines


def test_clip_rows_time_every_optimizer_on_both_parameter_sets():
    result = clip.clip_rows("tiny", device=torch.device("cpu"), rounds=1, side=64)
    assert list(result) == ["0.00391M single tensor", "LLaMA-tiny"]
    labels = [label for label, *_ in clip.ROWS] + ["adamw_swapped"]
    assert "frugal_rows_rho1_propagate" in labels and "frugal_blocks_rho0.25" in labels
    for part in result.values():
        assert [r["optimizer"] for r in part["rows"]] == labels
        for r in part["rows"]:
            assert r["step_ms"] > 0 and r["step_vs_fused_adamw"] > 0
            assert r["clip_step_ms"] > 0 and r["clip_step_vs_torch"] > 0
    text = "\n".join(_clip_lines(result))
    assert all(f"| {label} |" in text for label in labels)
