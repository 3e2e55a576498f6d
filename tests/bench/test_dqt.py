"""DQT's forward benchmark row (QuantLinear with quant_matmul vs nn.Linear): skipped with its
reason without CUDA, measured on a GPU; its table in the report (timings not asserted)."""

import pytest
import torch

from frugal_kernels.bench import dqt
from frugal_kernels.bench.report import markdown

FINGERPRINT = {"gpu": "x", "torch": "", "triton": "", "frugal_kernels": ""}
STEP = {"dim": 8, "batch": 4, "seconds": {"a": 1.0}, "vs_linear_adamw": {"a": 1.0}}


def _report(forward):
    return markdown({"fingerprint": FINGERPRINT, "command": "",
                     "dqt": {"storage": [], "step": STEP, "forward": forward}})


def test_forward_is_skipped_without_cuda_and_says_why():
    result = dqt.forward(dim=8, device=torch.device("cpu"))
    assert result == {"skipped": dqt.FORWARD_SKIPPED}
    assert "quant_matmul): skipped, needs a CUDA GPU" in _report(result)


def test_the_report_has_a_row_per_dtype_and_batch():
    rows = [{"dtype": d, "batch": b, "linear_s": 1e-3, "quant_s": 5e-4, "vs_linear": 0.5}
            for d in ("float32", "bfloat16") for b in (4, 2048)]
    text = _report({"dim": 4096, "bits": 4, "rows": rows})
    assert "QuantLinear 4-bit" in text
    assert text.count("| 0.50 |") == 4 and "| bfloat16 | 2048 |" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_forward_on_a_gpu():
    result = dqt.forward(dim=256, batches=(4, 64), rounds=2, device=torch.device("cuda"))
    assert [(r["dtype"], r["batch"]) for r in result["rows"]] == [
        ("float32", 4), ("float32", 64), ("bfloat16", 4), ("bfloat16", 64)]
    assert all(r["linear_s"] > 0 and r["quant_s"] > 0 for r in result["rows"])
