"""frugal::frugal_step_'s contract with the other ops as oracles; the generic op
tests (each backend against the reference over kinds, densities, index dtypes,
state-free rules and sizes, bad inputs, opcheck, ISA levels) are tests/ops/test_ops.py's,
driven by the FRUGAL_STEP entry of tests/op_db.py."""

import pytest
import torch

from frugal_kernels import ops

from ..op_db import FRUGAL_HYPER as HYPER
from ..op_db import frugal_case
from .helpers import assert_params_close, clone, cpu_backends


@pytest.mark.parametrize("backend", cpu_backends())
def test_state_full_coordinates_match_adamw_and_the_rest_signsgd(backend):
    """The op's contract spelled out on one tensor with the other ops as oracles."""
    params, grads, m, v, idx = frugal_case("rows", (16, 24), torch.float32, 0.25, seed=10)
    out = [clone(params), clone(m), clone(v)]
    ops.frugal_step_(out[0], grads, out[1], out[2], idx, kind="rows", step=3, backend=backend,
                     **HYPER)
    rows = idx[0]
    full_p = [params[0][rows].clone()]
    ops.adamw_(full_p, [grads[0][rows]], clone(m), clone(v), step=3, backend="torch", **HYPER)
    free_p = [params[0].clone()]
    ops.sign_sgd_(free_p, grads, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                  backend="torch")
    free_rows = torch.ones(16, dtype=torch.bool)
    free_rows[rows] = False
    assert_params_close([out[0][0][rows]], full_p)
    assert torch.equal(out[0][0][free_rows], free_p[0][free_rows])
