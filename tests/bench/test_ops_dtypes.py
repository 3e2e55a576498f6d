"""`frugal-kernels bench --dtypes`: the op sweep runs the parameter dtypes asked for."""

import torch

from frugal_kernels.bench import ops as bench_ops


def test_the_dtypes_option_reaches_the_op_sweep(tmp_path, monkeypatch):
    from frugal_kernels.__main__ import main

    seen = []
    real_sweep = bench_ops.sweep

    def sweep(**kwargs):
        seen.extend(kwargs["dtypes"])
        return real_sweep(**{**kwargs, "numels": [1 << 10], "op_names": ["sign_sgd_"], "rounds": 1})

    monkeypatch.setattr(bench_ops, "sweep", sweep)
    assert main(["bench", "--only", "ops", "--quick", "--device", "cpu", "--dtypes", "bfloat16",
                 "float16", "--out", str(tmp_path)]) == 0
    assert seen == [torch.bfloat16, torch.float16]
