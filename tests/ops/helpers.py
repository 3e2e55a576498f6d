"""Shared helpers of the op tests."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from frugal_kernels.ops import CAPABILITIES, _dispatch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The backends that can run on CPU tensors (cuda needs GPU tensors).
CPU_TENSOR_BACKENDS = ("cpu", "triton", "torch")
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def cpu_backends(op=None) -> list:
    """Every backend that can run (``op``, as the capability table says) on CPU
    tensors, as pytest params; one that cannot run here is shown as skipped with
    the reason (CI installs all)."""
    params = []
    for backend in CPU_TENSOR_BACKENDS:
        if op is not None and backend not in CAPABILITIES[op]:
            continue
        reason = _dispatch.unavailable_reason(backend, "cpu", op)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        params.append(pytest.param(backend, marks=marks, id=backend))
    return params


# The compiled CPU kernels, for tests of them alone (shown as skipped, with the reason,
# in a build without _C).
requires_cpu_backend = pytest.mark.skipif(
    _dispatch.unavailable_reason("cpu", "cpu") is not None,
    reason=str(_dispatch.unavailable_reason("cpu", "cpu")))


def clone(tensors: Sequence[torch.Tensor]) -> list:
    return [t.clone() for t in tensors]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64 (0 for empty or all-zero b equal to a)."""
    a, b = a.double(), b.double()
    if b.numel() == 0:
        return 0.0
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-dtype floats."""
    assert a.dtype == b.dtype
    if a.numel() == 0:
        return 0
    ia = a.contiguous().view(_INT_VIEW[a.dtype]).long()
    ib = b.contiguous().view(_INT_VIEW[b.dtype]).long()
    return int((ia - ib).abs().max())


def assert_params_close(actual, expected, *, fp32_rel=1e-6, ulps=1, what="params"):
    """fp32: relative difference; 16-bit: at most `ulps` units in the last place."""
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a.dtype == torch.float32:
            r = rel_diff(a, e)
            assert r <= fp32_rel, f"{what}[{i}]: relative difference {r:.3g} > {fp32_rel}"
        else:
            u = ulp_diff(a, e)
            assert u <= ulps, f"{what}[{i}] ({a.dtype}): {u} ulps apart (allowed {ulps})"


def assert_bits_close(actual, expected, *, fp32_ulps=0, ulps=1, what="params"):
    """At most `fp32_ulps` (fp32) or `ulps` (16-bit) units in the last place apart."""
    for i, (a, e) in enumerate(zip(actual, expected)):
        allowed = fp32_ulps if a.dtype == torch.float32 else ulps
        u = ulp_diff(a, e)
        assert u <= allowed, f"{what}[{i}] ({a.dtype}): {u} ulps apart (allowed {allowed})"


def make_batch(shapes, dtype, seed=0, state_shapes=None):
    """(params, grads, exp_avgs, exp_avg_sqs) for tensors of the given shapes,
    with moments as after some steps (v >= 0)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(s,) if isinstance(s, int) else tuple(s) for s in shapes]
    state_shapes = state_shapes or shapes
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    exp_avgs = [torch.randn(s, generator=gen) * 0.1 for s in state_shapes]
    exp_avg_sqs = [torch.rand(s, generator=gen) * 0.01 for s in state_shapes]
    return params, grads, exp_avgs, exp_avg_sqs


# ---------------------------------------------------------------- quant_matmul

# Unit roundoff of each output dtype: half the distance from 1 to the next value.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP32_EPS = 2.0**-23  # machine epsilon of the fp32 accumulator


def quant_matmul_case(m, rows, cols, bits, per_row, dtype, transpose_weight=True, bias=True,
                      seed=0):
    """(a, codes, scales, bias, q): a random weight over the whole code range, ``a`` of
    the product's inner size; ``q`` the int64 codes the packed ``codes`` hold."""
    from frugal_kernels import _quant
    gen = torch.Generator().manual_seed(seed)
    top = _quant.qmax(bits)
    q = torch.randint(-top, top + 1, (rows, cols), generator=gen)
    scales = torch.rand(rows if per_row else 1, generator=gen) * 0.5 + 0.05
    a = torch.randn(m, cols if transpose_weight else rows, generator=gen).to(dtype)
    b = torch.randn(rows if transpose_weight else cols, generator=gen).to(dtype) if bias else None
    return a, _quant.pack(q, bits), scales, b, q


def assert_within_gemm_bound(out, a, q, scales, bias, transpose_weight, what=""):
    """``out`` against ``a @ W.T + bias`` (``a @ W``) computed in float64 from the integer
    codes ``q``, with ``W = s * q`` (an fp32 product, as ``_quant`` defines the format)
    rounded to ``a``'s dtype as the op defines it.

    The bound: any fp32 evaluation of a sum of K products plus a bias, in any order,
    is within ``gamma * S`` of the exact sum, with ``S = sum_k |a_k| |w_k| + |b|``
    and ``gamma = (K + 2) * eps`` (``eps = 2**-23``: each of the K additions and
    the rounding of an fp32 product, with a factor 2 over the textbook ``K * u``
    that also covers accumulators which truncate instead of rounding). The result
    is then rounded once into the output dtype: another ``u_out * |result|``.
    Backends differ only in the order of the sums, so a wrong code, scale, bias or
    index is off by about one term ``|a_k| |w_k|``, far above the bound.
    """
    w = (q.float() * scales.reshape(-1, 1)).to(a.dtype).double()
    w = w.t() if transpose_weight else w
    a64 = a.double()
    exact = a64 @ w
    magnitude = a64.abs() @ w.abs()
    if bias is not None:
        exact = exact + bias.double()
        magnitude = magnitude + bias.double().abs()
    gamma = (a.shape[1] + 2) * FP32_EPS
    bound = gamma * magnitude + UNIT_ROUNDOFF[a.dtype] * (exact.abs() + gamma * magnitude)
    assert out.dtype == a.dtype and out.shape == exact.shape, f"{what}: {out.dtype} {out.shape}"
    err = (out.double() - exact).abs()
    over = err > bound
    assert not bool(over.any()), (f"{what}: {int(over.sum())} of {out.numel()} values beyond "
                                  f"the bound (worst error {float(err.max()):.3g}, bound there "
                                  f"{float(bound.flatten()[int(err.argmax())]):.3g})")
