"""frugal::lowrank_step_ by hand; the generic op tests (each backend against the
reference, empty tensors, bad inputs, opcheck, ISA levels) are tests/ops/test_ops.py's,
driven by the LOWRANK_STEP entry of tests/op_db.py."""

import pytest
import torch

from frugal_kernels import ops, reference
from frugal_kernels._layout import RIGHT

from ..op_db import LOWRANK_EMPTY, LOWRANK_STEP


def test_update_by_hand():
    """With P = the first r unit vectors, the op is FRUGAL's columns split."""
    p = torch.zeros(2, 3)
    g = torch.tensor([[1.0, -2.0, 3.0], [-4.0, 5.0, -6.0]])
    proj = torch.eye(3)[:1]  # RIGHT, r = 1: column 0 is the subspace
    low_grad = g @ proj.t()
    low_update = torch.tensor([[0.5], [0.25]])
    ops.lowrank_step_([p], [g], [low_update], [low_grad], [proj], [RIGHT], lr=0.1)
    expected = torch.tensor([[0.5, 0.1, -0.1], [0.25, -0.1, 0.1]])
    assert torch.allclose(p, expected, atol=1e-7)


@pytest.mark.parametrize("shape,side", [(s, d) for s, d in LOWRANK_EMPTY if s[0] == 0], ids=str)
def test_reference_takes_tensors_of_zero_rows(shape, side):
    sample = next(s for s in LOWRANK_STEP.samples if s.name.startswith(f"empty {shape}"))
    call = sample.make(torch.float32, "torch")
    before = [p.clone() for p in call[0][0]]
    (params,) = LOWRANK_STEP.run(reference.lowrank_step_, call, sample)
    assert [p.shape for p in params] == [b.shape for b in before]
    assert all(torch.equal(p, b) for p, b in zip(params, before))
