"""Property-based checks of the FRUGAL subset walk: random shapes and subsets.

The fast paths find a tile's state-full members with two binary searches and a
two-level enumeration (csrc/include/frugal/frugal_tile.h); hypothesis looks for
shapes, subsets and block boundaries where that walk and the reference disagree.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frugal_kernels import ops, reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import matrix_view, subset_dim
from frugal_kernels._layout import subset_state_shape as state_shape
from tests.ops.helpers import assert_bits_close

pytestmark = pytest.mark.skipif(extension() is None, reason="compiled extension not built")

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=2)


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["rows", "columns", "flat"]))
    dims = draw(st.lists(st.integers(1, 90), min_size=1, max_size=3))
    # Occasionally a long row or column, so tiles and CPU blocks (2048) cut rows.
    if draw(st.booleans()):
        dims[-1] = draw(st.integers(1000, 5000))
    shape = tuple(dims)
    dim = subset_dim(torch.empty(shape, device="meta"), kind)
    chosen = draw(st.sets(st.integers(0, dim - 1), max_size=min(dim, 400)))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    seed = draw(st.integers(0, 2**16))
    return kind, shape, sorted(chosen), index_dtype, seed


def _inputs(kind, shape, chosen, index_dtype, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor(chosen, dtype=index_dtype)
    st_shape = state_shape(torch.empty(shape, device="meta"), kind, len(chosen))
    p = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    m = torch.randn(st_shape, generator=gen) * 0.1
    v = torch.rand(st_shape, generator=gen) * 0.01
    return p, g, m, v, idx


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_cpu_kernel_matches_reference(case, dtype):
    kind, shape, chosen, index_dtype, seed = case
    p, g, m, v, idx = _inputs(*case, dtype=dtype)
    fast = [p.clone(), m.clone(), v.clone()]
    ref = [p.clone(), m.clone(), v.clone()]
    ops.frugal_step_([fast[0]], [g], [fast[1]], [fast[2]], [idx], kind=kind, backend="cpu",
                     **HYPER)
    reference.frugal_step_([ref[0]], [g], [ref[1]], [ref[2]], [idx], kind=kind, **HYPER)
    if dtype != torch.float32:
        # 16-bit parameters: the fp32 results may differ in their last bit (torch's
        # fused lerp and addcmul), so one unit apart after rounding, as in test_ops.py.
        assert_bits_close(fast[:1], ref[:1], ulps=1)
        fast, ref = fast[1:], ref[1:]
    for a, b in zip(fast, ref):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_cuda_kernel_logic_matches_cpu_kernel_bit_for_bit(case):
    """The CUDA kernel's tiles and phases, run on the emulated grid."""
    kind, shape, chosen, index_dtype, seed = case
    p, g, m, v, idx = _inputs(*case)
    ext = extension()
    runs = []
    for fn in (ext.frugal_step_cpu, ext.frugal_step_cuda_emulated):
        t = [p.clone(), m.clone(), v.clone()]
        code, rows, cols = matrix_view(p, kind)
        args = [ext.TensorBatch(dtype=0, numel=[p.numel()], params=[t[0].data_ptr()],
                                grads=[g.data_ptr()], exp_avgs=[t[1].data_ptr()],
                                exp_avg_sqs=[t[2].data_ptr()]),
                ext.SubsetBatch(kind=code, index_is_int32=index_dtype == torch.int32,
                                indices=[idx.data_ptr()], rows=[rows], cols=[cols],
                                k=[idx.numel()]),
                ext.FrugalHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                step=2.0, state_free_scale=1.0, state_free=0,
                                grad_scale=1.0, found_inf=0.0)]
        fn(*args, 1 if fn is ext.frugal_step_cpu else ext.DeviceScalars())
        runs.append(t)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
