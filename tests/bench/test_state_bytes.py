"""The bench's state-bytes table (bench/results: bytes per parameter of each optimizer),
measured from the state tensors: its rows on the tiny LLaMA set."""

import pytest
import torch

from frugal_kernels.bench.optimizers import llama_param_set, state_bytes


def test_state_bytes_rows_are_measured_from_the_state():
    model = llama_param_set("tiny", torch.device("cpu"))
    rows = {r["optimizer"]: r["bytes_per_param"] for r in state_bytes(model)}
    # Two fp32 moments, and a step count per tensor.
    assert rows["torch AdamW"] == pytest.approx(8.0, rel=1e-4)
    # 8-bit codes of both moments and an fp32 scale per block of 256: about 2 bytes per
    # parameter on the tensors large enough for them, fp32 on the rest (norms).
    assert 2.0 < rows["AdamW swapped, int8"] < 2.6
    assert rows["FRUGAL blocks rho=0.25 int8"] < rows["FRUGAL blocks rho=0.25"] / 2
