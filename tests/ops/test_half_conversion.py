"""fp16 storage on the CPU kernels: every finite half value, bit for bit.

With F16C the CPU kernels convert fp16 tiles with vector instructions instead
of the portable conversions of common.h; both must give torch's bits. Every
finite fp16 value goes through each elementwise op as a parameter (and as a
gradient), so a conversion that differs anywhere, subnormals and the values
that round to infinity included, fails here.
"""

import pytest
import torch

from frugal_kernels import ops
from tests.ops.helpers import assert_bits_close, requires_cpu_backend


def every_finite_half() -> torch.Tensor:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.float16)
    return values[torch.isfinite(values)]


def run(name, backend, params, grads):
    p, g = params.clone(), grads.clone()
    m, v = torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32)
    buf = torch.zeros_like(p, dtype=torch.float32)
    # Steps large enough to move most values by at least one unit in the last place,
    # and to push the largest ones past 65504 into infinity.
    if name == "adamw_":
        ops.adamw_([p], [g], [m], [v], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                   weight_decay=0.1, step=3, backend=backend)
        return p, m, v
    if name == "sign_sgd_":
        ops.sign_sgd_([p], [g], lr=8.0, weight_decay=1e-3, backend=backend)
        return (p,)
    ops.sgd_([p], [g], [buf], lr=0.5, momentum=0.9, weight_decay=0.01, backend=backend)
    return p, buf


@requires_cpu_backend
@pytest.mark.parametrize("name", ["adamw_", "sign_sgd_", "sgd_"])
def test_every_finite_half_matches_the_reference(name):
    params = every_finite_half()
    grads = params.flip(0)
    (got_p, *got_state), (want_p, *want_state) = (run(name, b, params, grads)
                                                  for b in ("cpu", "torch"))
    assert_bits_close([got_p], [want_p], ulps=0)
    # The fp32 state may differ in its last bit from torch's fused addcmul, as for
    # fp32 parameters (test_adamw.py): the conversions are what this test is about.
    assert_bits_close(got_state, want_state, fp32_ulps=1, what="state")
