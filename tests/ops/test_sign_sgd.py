"""frugal::sign_sgd_'s update rule by hand; the generic op tests (each backend
against the reference, bad inputs, opcheck, ISA levels) are tests/ops/test_ops.py's,
driven by the SIGN_SGD entry of tests/op_db.py."""

import torch

from frugal_kernels import ops


def test_update_rule_by_hand():
    p = torch.tensor([1.0, -2.0, 0.5, 3.0])
    g = torch.tensor([0.3, -1e-30, 0.0, -7.0])
    ops.sign_sgd_([p], [g], lr=0.1, weight_decay=0.5, scale=2.0)
    decay = 1 - 0.1 * 0.5
    expected = torch.tensor([1.0 * decay - 0.2, -2.0 * decay + 0.2, 0.5 * decay, 3.0 * decay + 0.2])
    assert torch.allclose(p, expected, rtol=0, atol=1e-6)
