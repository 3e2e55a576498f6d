"""What adamw_int8_ has beside the op table's generic tests: the quality of its 8-bit
moments against fp32 moments, the format's blocks along rows, and its edge values."""

import math

import pytest
import torch

from frugal_kernels import ops, reference
from frugal_kernels._layout import MOMENT_BLOCK, MomentBlocks

from .helpers import cpu_backends

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def sqnr(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (torchao's convention)."""
    return 10 * math.log10(exact.double().pow(2).sum().item()
                           / (approx.double() - exact.double()).pow(2).sum().item())


def zero_moments(p):
    b = MomentBlocks(p.shape)
    return (torch.zeros(p.shape, dtype=torch.int8), torch.zeros(b.scale_shape),
            torch.zeros(p.shape, dtype=torch.uint8), torch.zeros(b.scale_shape))


# The bounds, with the values measured (200 steps, gradients whose scale spreads over a
# decade within each row): m 32.4 dB, v 28.3 dB, the params' change 32.3 dB.
SQNR_BOUNDS = {"exp_avg": 30.0, "exp_avg_sq": 25.0, "update": 29.0}


def test_sqnr_of_8bit_moments_against_fp32_moments():
    """After 200 steps with the same gradients, the dequantized 8-bit moments and the
    change of the params stay close to fp32 AdamW's (every backend writes the reference's
    codes: one of them measures all)."""
    gen = torch.Generator().manual_seed(0)
    shape = (16, 1024)
    scale = 10 ** -torch.rand(shape, generator=gen)  # a decade within each row
    mean = 0.3 * torch.randn(shape, generator=gen)
    p0 = torch.randn(shape, generator=gen)
    p8, p32 = p0.clone(), p0.clone()
    q = zero_moments(p8)
    m, v = torch.zeros(shape), torch.zeros(shape)
    for step in range(1, 201):
        g = scale * (mean + torch.randn(shape, generator=gen))
        ops.adamw_int8_([p8], [g], *([t] for t in q), step=step, **HYPER)
        ops.adamw_([p32], [g], [m], [v], step=step, backend="torch", **HYPER)
    measured = {"exp_avg": sqnr(reference.dequantize_moment(q[0], q[1], False), m),
                "exp_avg_sq": sqnr(reference.dequantize_moment(q[2], q[3], True), v),
                "update": sqnr(p8 - p0, p32 - p0)}
    for name, bound in SQNR_BOUNDS.items():
        assert measured[name] >= bound, f"{name}: SQNR {measured[name]:.1f} dB < {bound}"


def test_round_trip_error_is_half_a_code():
    gen = torch.Generator().manual_seed(1)
    m = torch.randn(7, 700, generator=gen)
    codes, scales = reference.quantize_moment(m, False)
    back = reference.dequantize_moment(codes, scales, False)
    step = scales.repeat_interleave(MOMENT_BLOCK, dim=1)[:, :700]
    assert ((back - m).abs() <= step * 0.5 * (1 + 1e-6)).all()
    assert codes.abs().max() == 127
    v = torch.rand(7, 700, generator=gen) ** 8
    codes, scales = reference.quantize_moment(v, True)
    back = reference.dequantize_moment(codes, scales, True)
    # Half a code on the fourth root, and every v keeps a code > 0 down to (1/510)^4 of
    # its block's largest.
    root_step = scales.repeat_interleave(MOMENT_BLOCK, dim=1)[:, :700]
    assert ((back.sqrt().sqrt() - v.sqrt().sqrt()).abs() <= root_step * (0.5 + 1e-5)).all()
    assert codes.max() == 255


def test_blocks_never_straddle_rows():
    """A block of rows updates as those rows of the whole tensor do (the state a row
    shard holds is the whole's): rows 3..9 of a [10, 300] tensor stepped alone."""
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(10, 300, generator=gen)
    q = [t.clone() for t in reference.quantize_moment(torch.randn(10, 300, generator=gen), False)]
    q += reference.quantize_moment(torch.rand(10, 300, generator=gen), True)
    g = torch.randn(10, 300, generator=gen)
    part = [p[3:].clone(), g[3:].clone(), *(t[3:].clone() for t in q)]
    ops.adamw_int8_([p], [g], *([t] for t in q), step=3, backend="auto", **HYPER)
    ops.adamw_int8_([part[0]], [part[1]], *([t] for t in part[2:]), step=3, backend="auto",
                    **HYPER)
    for whole, rows in zip([p, *q], [part[0], *part[2:]]):
        assert torch.equal(whole[3:], rows)


@pytest.mark.parametrize("backend", cpu_backends("frugal::adamw_int8_"))
def test_zero_gradients_keep_zero_moments_and_non_finite_values_agree(backend):
    p = torch.randn(4, 600)
    q = zero_moments(p)
    ops.adamw_int8_([p], [torch.zeros_like(p)], *([t] for t in q), step=1, backend=backend,
                    **HYPER)
    assert all(t.count_nonzero() == 0 for t in q)
    # A NaN or an inf in a block makes that block's moments non-finite (a NaN or inf scale),
    # on every backend alike; other blocks are untouched by it.
    g = torch.randn(4, 600)
    g[0, 5], g[2, 300] = float("nan"), float("inf")
    runs = []
    for b in ("torch", backend):
        qb = [t.clone() for t in q]
        pb = p.clone()
        ops.adamw_int8_([pb], [g], *([t] for t in qb), step=2, backend=b, **HYPER)
        runs.append([pb, *qb])
    for a, e in zip(*runs):
        assert torch.equal(a.nan_to_num(1.5), e.nan_to_num(1.5))
    scales = runs[0][2]
    assert scales[0, 0].isnan() and scales[2, 1].isinf() and scales[1].isfinite().all()


@pytest.mark.parametrize("backend", cpu_backends("frugal::adamw_int8_"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_moment_scales_decaying_into_subnormals_agree_with_the_reference(backend, dtype):
    # The CPU kernel writes a block's codes without moment_code's clamp and NaN test only
    # where both its scales are in [2^-126, 2^126]. With zero gradients after the first
    # step, m decays by beta1 a step and v by beta2: by step 120 the first moment's scale
    # is subnormal (its inverse inexact or inf) while the second's is still normal, and
    # every step's codes, scales and params must be the reference's.
    hyper = {**HYPER, "beta1": 0.5}
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(3, 300, generator=gen).to(dtype)
    g = torch.randn(3, 300, generator=gen).to(dtype)
    runs = []
    for b in ("torch", backend):
        q, p = zero_moments(p0), p0.clone()
        ops.adamw_int8_([p], [g], *([t] for t in q), step=1, backend=b, **hyper)
        states = []
        for step in range(2, 126):
            ops.adamw_int8_([p], [torch.zeros_like(g)], *([t] for t in q), step=step, backend=b,
                            **hyper)
            if step >= 100:
                states.append([p.clone(), *(t.clone() for t in q)])
        runs.append(states)
    assert 0 < runs[0][-1][2].max() < 2.0 ** -126 < runs[0][-1][4].min()
    for ours, theirs in zip(runs[1], runs[0]):
        for a, e in zip(ours, theirs):
            assert torch.equal(a, e)
