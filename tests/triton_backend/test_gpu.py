"""The triton backend compiled on a CUDA GPU, against the C++ cpu backend.

Skipped without CUDA; the interpreter tests of the same kernels are in
test_kernels.py. On the GPU the kernels must still give the cpu
backend's bits: IEEE division and square root, no FMA contraction, and
rounding to nearest even into bf16 / fp16 (NaN bits excepted: the GPU's
conversions keep their own NaN patterns).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from frugal_kernels import _quant, ops
from frugal_kernels._layout import subset_dim
from frugal_kernels._layout import subset_state_shape as state_shape

from ..ops.helpers import assert_within_gemm_bound, quant_matmul_case
from ..required import skip_unless_required

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
# The reference here is the cpu backend: on a GPU machine without it, every test would skip.
if torch.cuda.is_available() and "cpu" not in ops.usable_backends("cpu"):
    skip_unless_required("frugal_kernels._C is not built (the cpu backend)")

HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Mixed sizes with an empty tensor, partial tiles, and one of ~250 tiles.
SIZES = [1, 7, 4097, 0, 1_000_003]
FRUGAL_CASES = {
    "rows": [((700, 7), 0.5), ((3, 2500), 0.67), ((1024, 1000), 0.25), ((5000,), 1.0)],
    "columns": [((700, 7), 0.43), ((3, 2500), 0.5), ((1000, 1024), 0.25), ((4, 5), 0.0)],
    "flat": [((700, 7), 0.5), ((1000, 1000), 0.25), ((4097,), 0.99)],
}


def assert_same_bits(actual, expected, what: str) -> None:
    for i, (a, e) in enumerate(zip(actual, expected)):
        a = a.cpu()
        ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
        differ = (a.view(ints) != e.view(ints)) & ~(a.isnan() & e.isnan())
        count = int(differ.sum())
        assert count == 0, f"{what}[{i}]: {count} of {a.numel()} values differ from the cpu backend"


def scalars(lr: float, step: int, where: str):
    """lr and step as the op takes them: numbers, or tensors on the GPU (read in the kernel)."""
    if where == "host":
        return lr, step
    return (torch.tensor(lr, dtype=torch.float64, device="cuda"),
            torch.tensor(float(step), dtype=torch.float32, device="cuda"))


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adamw_and_sign_sgd(dtype, where):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
    ours = [[p.cuda() for p in params], [torch.zeros(n, device="cuda") for n in SIZES],
            [torch.zeros(n, device="cuda") for n in SIZES]]
    theirs = [[p.clone() for p in params], [torch.zeros(n) for n in SIZES],
              [torch.zeros(n) for n in SIZES]]
    for step in range(1, 4):
        grads = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
        lr, step_value = scalars(3e-2, step, where)
        ops.adamw_(ours[0], [g.cuda() for g in grads], *ours[1:], lr=lr, step=step_value,
                   backend="triton", **HYPER)
        ops.adamw_(theirs[0], grads, *theirs[1:], lr=3e-2, step=step, backend="cpu", **HYPER)
        ops.sign_sgd_(ours[0], [g.cuda() for g in grads], lr=lr, weight_decay=0.1, scale=0.5,
                      backend="triton")
        ops.sign_sgd_(theirs[0], grads, lr=3e-2, weight_decay=0.1, scale=0.5, backend="cpu")
        for name, a, e in zip(("params", "exp_avgs", "exp_avg_sqs"), ours, theirs):
            assert_same_bits(a, e, f"{name} at step {step}")


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["rows", "columns", "flat"])
def test_frugal_step(kind, dtype, where):
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(shape, generator=gen).to(dtype) for shape, _ in FRUGAL_CASES[kind]]
    indices = []
    for p, (_, density) in zip(params, FRUGAL_CASES[kind]):
        n = subset_dim(p, kind)
        indices.append(torch.randperm(n, generator=gen)[:round(n * density)].sort().values)
    moments = [torch.zeros(state_shape(p, kind, idx.numel())) for p, idx in zip(params, indices)]
    ours = [[t.cuda() for t in params], [m.cuda() for m in moments], [m.cuda() for m in moments]]
    theirs = [[t.clone() for t in params], [m.clone() for m in moments],
              [m.clone() for m in moments]]
    cuda_indices = [idx.int().cuda() for idx in indices]
    for step in range(1, 4):
        grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in params]
        lr, step_value = scalars(2e-2, step, where)
        ops.frugal_step_(ours[0], [g.cuda() for g in grads], *ours[1:], cuda_indices, kind=kind,
                         lr=lr, step=step_value, state_free="sign", state_free_scale=0.5,
                         backend="triton", **HYPER)
        ops.frugal_step_(theirs[0], grads, *theirs[1:], indices, kind=kind, lr=2e-2, step=step,
                         state_free="sign", state_free_scale=0.5, backend="cpu", **HYPER)
        for name, a, e in zip(("params", "exp_avgs", "exp_avg_sqs"), ours, theirs):
            assert_same_bits(a, e, f"{name} at step {step}")


# dqt_update_: weights [R, C] per kind, with short rows many to a tile, rows cut
# by tiles, and one of ~1000 tiles; every code width, in a call of its own.
DQT_CASES = {
    "rows": [((700, 7), 0.5), ((3, 2500), 0.67), ((1024, 1000), 0.25)],
    "columns": [((700, 7), 0.43), ((3, 2500), 0.5), ((1000, 1024), 0.25)],
    "flat": [((700, 7), 0.5), ((1000, 1000), 0.25), ((4097, 1), 0.99)],
}


# fp32 gradients with host scalars, bf16 with device ones: each kind compiles 4
# code widths x 2 variants, not x 4.
@pytest.mark.parametrize("dtype, where", [(torch.float32, "host"), (torch.bfloat16, "device")],
                         ids=["fp32-host", "bf16-device"])
@pytest.mark.parametrize("kind", ["rows", "columns", "flat"])
def test_dqt_update(kind, dtype, where):
    """The codes (every rounding decision) and the moments equal the cpu backend's."""
    gen = torch.Generator().manual_seed(3)
    for bits in _quant.QUANT_BITS:
        top = _quant.qmax(bits)
        codes, scales, indices, moments = [], [], [], []
        for i, (shape, density) in enumerate(DQT_CASES[kind]):
            codes.append(_quant.pack(torch.randint(-top, top + 1, shape, generator=gen), bits))
            scales.append(torch.rand(shape[0] if i % 2 else 1, generator=gen) * 0.02 + 0.01)
            n = subset_dim(torch.empty(shape, device="meta"), kind)
            indices.append(torch.randperm(n, generator=gen)[:round(n * density)].sort().values)
            moments.append(torch.zeros(state_shape(torch.empty(shape, device="meta"), kind,
                                                   indices[-1].numel())))
        ours = [[t.cuda() for t in codes], [m.cuda() for m in moments],
                [m.cuda() for m in moments]]
        theirs = [[t.clone() for t in codes], [m.clone() for m in moments],
                  [m.clone() for m in moments]]
        common = dict(bits=bits, kind=kind, seeds=list(range(len(codes))), state_free="sign",
                      state_free_scale=0.5, **HYPER)
        for step in range(1, 4):
            grads = [(0.3 * torch.randn(shape, generator=gen)).to(dtype)
                     for shape, _ in DQT_CASES[kind]]
            lr, step_value = scalars(2e-2, step, where)
            ops.dqt_update_(ours[0], [s.cuda() for s in scales], [g.cuda() for g in grads],
                            *ours[1:], [idx.int().cuda() for idx in indices], lr=lr,
                            step=step_value, rng_step=step, backend="triton", **common)
            ops.dqt_update_(theirs[0], scales, grads, *theirs[1:], indices, lr=2e-2, step=step,
                            rng_step=step, backend="cpu", **common)
            for i, (a, e) in enumerate(zip(ours[0], theirs[0])):
                differ = int((a.cpu() != e).sum())
                assert differ == 0, f"codes[{i}] ({bits} bits) at step {step}: {differ} bytes"
            for name, a, e in zip(("exp_avgs", "exp_avg_sqs"), ours[1:], theirs[1:]):
                assert_same_bits(a, e, f"{name} ({bits} bits) at step {step}")


# lowrank_step_: (shape, rank, side) with ragged tiles (64 x 64 x 32), rank 1,
# ranks past BLOCK_K, and one tensor of ~250 tiles.
LOWRANK_CASES = [((65, 130), 1, 0), ((129, 1030), 70, 1), ((1000, 1024), 96, 0),
                 ((5, 3, 13), 4, 1)]


def lowrank_batch(dtype, gen, exact: bool):
    """(params, grads, low_updates, low_grads, projections, sides). ``exact``: P of
    -1 / 0 / 1 and low tensors of multiples of 1/64, so the back-projections are exact
    in fp32 whatever the order of the sums; otherwise orthonormal P, as the optimizer's."""
    columns = [[] for _ in range(5)]
    for shape, rank, side in LOWRANK_CASES:
        m = shape[0]
        n = torch.Size(shape[1:]).numel()
        p = torch.randn(shape, generator=gen).to(dtype)
        g = torch.randn(shape, generator=gen).to(dtype)
        proj_shape = (rank, n) if side == 0 else (m, rank)
        if exact:
            proj = torch.randint(-1, 2, proj_shape, generator=gen).float()
            low_shape = (m, rank) if side == 0 else (rank, n)
            lg = torch.randint(-64, 65, low_shape, generator=gen).float() / 64
        else:
            q, _ = torch.linalg.qr(torch.randn(max(proj_shape), rank, generator=gen))
            proj = q.t().contiguous() if side == 0 else q.contiguous()
            g2 = g.float().reshape(m, n)
            lg = g2 @ proj.t() if side == 0 else proj.t() @ g2
        u = torch.randint(-64, 65, lg.shape, generator=gen).float() / 64
        for column, t in zip(columns, (p, g, u, lg, proj)):
            column.append(t)
    return columns + [[side for _, _, side in LOWRANK_CASES]]


# Each dtype with one place for lr, not both: 9 tests of 3 compilations each (the sides,
# and N % 16 for side 0), not 18; the path of the scalars does not depend on the dtype.
@pytest.mark.parametrize("dtype, where", [(torch.float32, "host"), (torch.bfloat16, "device"),
                                          (torch.float16, "host")],
                         ids=["fp32-host", "bf16-device", "fp16-host"])
@pytest.mark.parametrize("state_free", ["sign", "sgd", "none"])
def test_lowrank_step(state_free, dtype, where):
    """Exact back-projections: the cpu backend's bits. Orthonormal P: the products are
    IEEE fp32 (no TF32), so only signs of residuals within rounding of zero may differ."""
    gen = torch.Generator().manual_seed(2)
    lr = 0.7 if where == "host" else torch.tensor(0.7, dtype=torch.float64, device="cuda")
    kw = dict(weight_decay=0.3, state_free=state_free, state_free_scale=0.5)
    for exact in (True, False):
        *tensors, sides = lowrank_batch(dtype, gen, exact)
        ours = [t.cuda() for t in tensors[0]]
        theirs = [t.clone() for t in tensors[0]]
        ops.lowrank_step_(ours, *[[t.cuda() for t in c] for c in tensors[1:]], sides, lr=lr,
                          backend="triton", **kw)
        ops.lowrank_step_(theirs, *tensors[1:], sides, lr=0.7, backend="cpu", **kw)
        if exact:
            assert_same_bits(ours, theirs, "params (exact back-projections)")
            continue
        for i, (a, e) in enumerate(zip(ours, theirs)):
            a, e = a.cpu().float(), e.float()
            scale = 1e-5 if dtype == torch.float32 else 1e-2
            apart = float(((a - e).abs() > scale * e.abs().clamp_min(1.0)).float().mean())
            assert apart <= (0.002 if state_free == "sign" else 0.0), (
                f"params[{i}]: {apart:.3%} of the coordinates apart from the cpu backend")


def test_device_scalars_do_not_sync():
    """lr and step on the GPU are read by the kernels: no host synchronisation."""
    p = torch.randn(10_000, device="cuda")
    g = torch.randn(10_000, device="cuda")
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    idx = torch.arange(0, 10_000, 3, device="cuda")
    fm, fv = torch.zeros(idx.numel(), device="cuda"), torch.zeros(idx.numel(), device="cuda")
    proj = torch.linalg.qr(torch.randn(100, 8, device="cuda"))[0].t().contiguous()
    low = torch.randn(100, 8, device="cuda")
    lr, step = scalars(1e-3, 2, "device")
    codes = torch.zeros(100, 50, dtype=torch.uint8, device="cuda")
    scale = torch.full((1,), 0.01, device="cuda")

    def run():
        ops.adamw_([p], [g], [m], [v], lr=lr, step=step, backend="triton", **HYPER)
        ops.sign_sgd_([p], [g], lr=lr, backend="triton")
        ops.sgd_([p], [g], [m], lr=lr, momentum=0.9, nesterov=True, backend="triton")
        ops.frugal_step_([p], [g], [fm], [fv], [idx], kind="flat", lr=lr, step=step,
                         backend="triton", check_indices=False, **HYPER)
        ops.lowrank_step_([p.view(100, 100)], [g.view(100, 100)], [low], [low], [proj], [0],
                          lr=lr, backend="triton")
        ops.dqt_update_([codes], [scale], [g.view(100, 100)], [fm], [fv], [idx], bits=4,
                        kind="flat", seeds=[1], rng_step=2, lr=lr, step=step, backend="triton",
                        check_indices=False, **HYPER)

    run()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
def test_dequantize(bits, dtype):
    """Compiled, the reference's bits (an fp32 product rounded once, as on the CPU)."""
    gen = torch.Generator().manual_seed(bits)
    top = _quant.qmax(bits)
    for shape, per_row in (((300, 1), False), ((37, 9), True), ((1000, 4099), True)):
        q = torch.randint(-top, top + 1, shape, generator=gen)
        codes = _quant.pack(q, bits)
        scales = torch.rand(shape[0] if per_row else 1, generator=gen) + 1e-3
        got = ops.dequantize(codes.cuda(), scales.cuda(), bits=bits, cols=shape[1],
                             dtype=dtype, backend="triton")
        assert_same_bits([got], [(q.float() * scales.reshape(-1, 1)).to(dtype)],
                         f"dequantize {shape}")


# (bits, transpose_weight, dtype): every width, both products and every dtype, in
# few compiled variants (each costs a Triton compilation).
QUANT_MATMUL_CASES = [(2, True, torch.bfloat16), (2, False, torch.float32),
                      (3, True, torch.float16), (3, False, torch.bfloat16),
                      (4, True, torch.float32), (4, False, torch.float16),
                      (8, True, torch.bfloat16), (8, False, torch.float32)]


@pytest.mark.parametrize("bits,transpose_weight,dtype", QUANT_MATMUL_CASES, ids=str)
def test_quant_matmul(bits, transpose_weight, dtype):
    """Compiled (native bf16 / fp16 tensor-core products; IEEE fp32 ones), within the
    bound of tests.ops.helpers.assert_within_gemm_bound of the exact product, at a
    decoding shape (tiles of 16 rows) and one with many tiles and ragged edges."""
    for i, (m, rows, cols) in enumerate(((4, 4096, 4096), (300, 1000, 777))):
        a, codes, scales, bias, q = quant_matmul_case(m, rows, cols, bits, i % 2 == 0, dtype,
                                                      transpose_weight, seed=i)
        out = ops.quant_matmul(a.cuda(), codes.cuda(), scales.cuda(), bias.cuda(), bits=bits,
                               cols=cols, transpose_weight=transpose_weight, backend="triton")
        assert_within_gemm_bound(out.cpu(), a, q, scales, bias, transpose_weight,
                                 what=f"{(m, rows, cols)}")


@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["2", "inf"])
def test_grad_norm(norm_type):
    """The compiled norm kernel against the cpu backend (fp64 sums in another order: equal
    to fp32 rounding) and its flag for every non-finite value."""
    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(n, generator=gen) * 3).to(dtype)
             for dtype in DTYPES for n in SIZES]
    norm, found = ops.grad_norm([g.cuda() for g in grads], norm_type=norm_type,
                                backend="triton")
    expected, _ = ops.grad_norm(grads, norm_type=norm_type, backend="cpu")
    assert norm.device.type == "cuda" and found.item() == 0.0
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    for bad, want in [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "inf")]:
        broken = [g.cuda() for g in grads]
        broken[4][999_999] = bad
        norm, found = ops.grad_norm(broken, norm_type=norm_type, backend="triton")
        assert found.item() == 1.0
        assert str(norm.item()) == want
