"""What `frugal-kernels bench` tells a user beside each ratio: the machine's load, the
round-to-round spread, and whether the ratio lies outside the range recorded for this
machine class (noise or regression)."""

import json

import pytest
import torch

from frugal_kernels.bench import ops as bench_ops
from frugal_kernels.bench.fingerprint import fingerprint
from frugal_kernels.bench.report import markdown, recorded_ranges
from frugal_kernels.bench.timing import ratio_spread

FP = {"device_type": "cpu", "cpu": "x", "cpu_isa": "avx2", "threads": 2, "logical_cpus": 2,
      "torch": "", "triton": "", "frugal_kernels": ""}


def _row(ratio, spread=None, op="adamw_"):
    return {"op": op, "variant": "", "backend": "cpu", "dtype": "float32", "numel": 1 << 22,
            "seconds": 1e-3, "gbps": 10.0, "roofline_fraction": 0.5, "copy_fraction": 0.6,
            "speedup_vs_torch_adamw_fused": ratio, "speedup_spread": spread}


def test_ratio_spread_is_the_interquartile_range_of_per_round_ratios():
    assert ratio_spread([2.0, 2.0, 2.0, 2.0, 2.0], [1.0, 2.0, 4.0, 1.0, 2.0]) == \
        pytest.approx([1.0, 2.0])
    assert ratio_spread([3.0], [1.5]) == [2.0, 2.0]


def test_the_sweep_reports_each_ratios_spread():
    rows = bench_ops.sweep(device=torch.device("cpu"), numels=[1 << 12],
                           dtypes=[torch.float32], rounds=3, op_names=["adamw_"])
    for row in rows:
        lo, hi = row["speedup_spread"]
        assert 0 < lo <= hi


def test_load_and_spread_beside_each_ratio_and_a_ratio_outside_the_record_flagged(tmp_path):
    # Recorded for this machine class: adamw_ between 0.98 and 1.6 (two files, two sizes).
    (tmp_path / "x-avx2.json").write_text(json.dumps({"ops": [_row(1.6), _row(0.98)]}))
    (tmp_path / "x-avx2-quick.json").write_text(json.dumps({"ops": [_row(1.2)]}))
    recorded = recorded_ranges(tmp_path, "x-avx2")
    assert recorded == {"adamw_[]/cpu/float32": [0.98, 1.6]}
    busy = dict(FP, load_average=[15.5, 15.1, 10.6])
    text = markdown({"fingerprint": busy, "command": "", "recorded_ranges": recorded,
                     "ops": [_row(0.33, [0.25, 0.41]), _row(1.1, [1.0, 1.2], op="sign_sgd_")]})
    assert "Load: 15.50 / 15.10 / 10.60 (1 / 5 / 15 min) on 2 logical CPUs" in text
    assert "the machine was busy" in text
    assert "0.33 (0.25-0.41) **outside the recorded 0.98-1.60: noise or regression**" in text
    # Within the record, or nothing recorded for it: no flag.
    text = markdown({"fingerprint": dict(FP, load_average=[0.1, 0.1, 0.1]), "command": "",
                     "recorded_ranges": recorded, "ops": [_row(1.2, [1.1, 1.3])]})
    assert "1.20 (1.10-1.30) |" in text and "noise or regression" not in text
    assert "the machine was busy" not in text


def test_the_fingerprint_records_the_load():
    fp = fingerprint(torch.device("cpu"))
    assert len(fp["load_average"]) == 3 and fp["logical_cpus"] >= 1
