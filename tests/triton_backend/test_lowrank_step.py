"""The Triton kernel of frugal::lowrank_step_ under the interpreter: tiles, ranks, sides,
dtypes, rules and the scalars, against the C++ cpu backend and the reference.

tests/ops/test_lowrank_step.py already runs every backend against the reference
on realistic inputs (orthonormal P), where GEMMs that sum in different orders
may flip the sign of a near-zero residual. Here most cases are built so that
both back-projections are exact in fp32 whatever the order of the sums (P of
-1 / 0 / 1, low tensors of multiples of 1/64): the kernel must then give the
bits of the cpu backend (torch GEMMs, then update_rules.h ``lowrank_update``),
in every dtype and for every state-free rule, sign included.

The module fixture runs the kernel interpreted, as the one of test_kernels.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import textwrap

import pytest
import torch

from frugal_kernels import ops, reference
from frugal_kernels._layout import LEFT, RIGHT

from .helpers import (assert_near_reference, assert_same_bits, compile_for_h200,
                      cpu_backend_available, interpreted, needs_cpu)

if importlib.util.find_spec("triton") is None:
    pytest.skip("the triton backend needs triton installed", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HYPER = dict(weight_decay=0.1, state_free_scale=0.5)

# (shape, rank, side) against the tiles (BLOCK_M = BLOCK_N = 64, BLOCK_K = 32),
# all in one call: a single coordinate, rank 1 on ragged tiles, ranks past one
# and two BLOCK_K steps with ragged M and N, one exact tile, a 3-D tensor seen
# as [3, 65], and 10 x 2 tiles (more tile rows than GROUP_M = 8: a full group
# and a partial one in the program order).
CASES = [((1, 1), 1, RIGHT), ((65, 130), 1, LEFT), ((70, 129), 33, RIGHT),
         ((129, 64), 70, LEFT), ((64, 64), 64, RIGHT), ((3, 5, 13), 4, LEFT),
         ((600, 70), 5, LEFT)]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    for modules in interpreted(("_common", "sign_sgd", "lowrank_step")):
        yield modules["lowrank_step"]


def exact_case(shape, rank, side, dtype, gen):
    """(p, g, low_update, low_grad, P) whose back-projections are exact in fp32: P of
    -1 / 0 / 1 and low tensors of k / 64, |k| <= 64, so every partial sum is a
    multiple of 1/64 under 2^7 (13 significant bits at most)."""
    m = shape[0]
    n = torch.Size(shape[1:]).numel()
    proj_shape = (rank, n) if side == RIGHT else (m, rank)
    low_shape = (m, rank) if side == RIGHT else (rank, n)
    p = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    proj = torch.randint(-1, 2, proj_shape, generator=gen).float()
    u = torch.randint(-64, 65, low_shape, generator=gen).float() / 64
    lg = torch.randint(-64, 65, low_shape, generator=gen).float() / 64
    return p, g, u, lg, proj


def exact_batch(dtype, seed=0, cases=CASES):
    gen = torch.Generator().manual_seed(seed)
    built = [exact_case(shape, rank, side, dtype, gen) for shape, rank, side in cases]
    return [list(column) for column in zip(*built)], [side for _, _, side in cases]


def run(backend, batch, sides, lr, state_free, **kw):
    params = [p.clone() for p in batch[0]]
    ops.lowrank_step_(params, *batch[1:], sides, lr=lr, state_free=state_free, backend=backend,
                      **{**HYPER, **kw})
    return params


# ---------------------------------------------------------------- exact back-projections

@pytest.mark.parametrize("state_free", ["sign", "sgd", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiles_ranks_sides(dtype, state_free):
    batch, sides = exact_batch(dtype)
    inputs = [[t.clone() for t in column] for column in batch[1:]]
    ours = run("triton", batch, sides, 3e-2, state_free)
    assert_near_reference(ours, run("torch", batch, sides, 3e-2, state_free), "params vs torch")
    if cpu_backend_available():
        assert_same_bits(ours, run("cpu", batch, sides, 3e-2, state_free), "params vs cpu")
    for name, before, after in zip(("grads", "low_updates", "low_grads", "projections"), inputs,
                                   batch[1:]):
        assert_same_bits(after, before, f"{name} (read only)")
    # (A single 16-bit coordinate may not move by a step under its ulp.)
    moved = [not torch.equal(a, b) for a, b in zip(ours, batch[0]) if a.numel() > 1]
    assert all(moved), "a parameter did not change"


@needs_cpu
@pytest.mark.parametrize("where", ["host", "kernel"])
def test_lr_as_tensor(kernel, where):
    """lr as a 0-dim tensor: read on the host (derived in double there), or read by the
    kernel (derived in fp64 in the kernel, the path of lr on a GPU): the cpu backend's
    bits either way."""
    cases = [((70, 129), 33, RIGHT), ((65, 130), 2, LEFT)]
    batch, sides = exact_batch(torch.float32, seed=1, cases=cases)
    # Values whose scalars differ when derived in fp32 rather than in double then
    # rounded: 1 - lr * wd for the first, lr * scale for the second.
    for lr, wd, scale in ((torch.tensor(0.7), 0.3, 0.5),
                          (torch.tensor(1e-2, dtype=torch.float64), 0.0, 0.7)):
        ours = [p.clone() for p in batch[0]]
        kernel.lowrank_step_(ours, *batch[1:], sides, lr=lr, weight_decay=wd, state_free="sign",
                             state_free_scale=scale, scalars_in_kernel=where == "kernel")
        expected = run("cpu", batch, sides, lr, "sign", weight_decay=wd, state_free_scale=scale)
        assert_same_bits(ours, expected, f"params, lr {float(lr)}")


def test_update_by_hand():
    """P = two unit rows (RIGHT) and their transpose (LEFT): the subspace is two columns
    (rows) of p; the others move by -lr * scale * sign(g)."""
    g = torch.tensor([[1.0, -2.0, 3.0, 0.0], [-4.0, 5.0, -6.0, 7.0]])
    proj = torch.eye(4)[[0, 2]]  # columns 0 and 2
    low_update = torch.tensor([[0.5, -0.5], [0.25, 1.0]])
    for side, gt, pj, u in ((RIGHT, g, proj, low_update), (LEFT, g.t(), proj.t(), low_update.t())):
        p = torch.zeros(gt.shape)
        low_grad = gt @ pj.t() if side == RIGHT else pj.t() @ gt
        ops.lowrank_step_([p], [gt.contiguous()], [u.contiguous()], [low_grad.contiguous()],
                          [pj.contiguous()], [side], lr=0.1, state_free_scale=0.5,
                          backend="triton")
        expected = torch.tensor([[0.5, 0.05, -0.5, 0.0], [0.25, -0.05, 1.0, -0.05]])
        torch.testing.assert_close(p, expected if side == RIGHT else expected.t(), rtol=0,
                                   atol=1e-7)


# ---------------------------------------------------------------- realistic projections

@pytest.mark.parametrize("side", [RIGHT, LEFT])
def test_orthonormal_projection(side):
    """Orthonormal P (QR of a Gaussian), as the optimizer's: sgd and none agree with the
    reference to rounding; sign by the fraction of coordinates apart (DESIGN.md 6)."""
    gen = torch.Generator().manual_seed(2)
    m, n, r = 150, 97, 40
    p = torch.randn(m, n, generator=gen)
    g = torch.randn(m, n, generator=gen)
    q, _ = torch.linalg.qr(torch.randn(n if side == RIGHT else m, r, generator=gen))
    proj = q.t().contiguous() if side == RIGHT else q.contiguous()
    lg = g @ proj.t() if side == RIGHT else proj.t() @ g
    u = torch.randn(lg.shape, generator=gen) * 1e-3
    for state_free in ("sgd", "none", "sign"):
        ours, expected = [p.clone()], [p.clone()]
        kw = dict(lr=1e-2, state_free=state_free, **HYPER)
        ops.lowrank_step_(ours, [g], [u], [lg], [proj], [side], backend="triton", **kw)
        reference.lowrank_step_(expected, [g], [u], [lg], [proj], [side], **kw)
        apart = ((ours[0] - expected[0]).abs() > 1e-6).float().mean().item()
        assert apart <= (0.002 if state_free == "sign" else 0.0), (state_free, apart)


# ---------------------------------------------------------------- GPU code, without a GPU

_COMPILE = textwrap.dedent("""
    import re, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from frugal_kernels.kernels.triton import lowrank_step as k

    # The FMAs of the two fp32 dots: BLOCK_M * BLOCK_N * BLOCK_K each, over the threads.
    dot_fmas = 2 * k.BLOCK_M * k.BLOCK_N * k.BLOCK_K // (32 * k.NUM_WARPS)
    for side, param, in_kernel in ((0, "fp32", False), (1, "bf16", True), (0, "fp16", True)):
        constexprs = dict(AMP=in_kernel, SIDE=side, STATE_FREE=0, SCALARS_IN_KERNEL=in_kernel,
                          BLOCK_M=k.BLOCK_M, BLOCK_N=k.BLOCK_N, BLOCK_K=k.BLOCK_K,
                          GROUP_M=k.GROUP_M, RANK_STEPS=4)  # rank 97 to 128
        if not in_kernel:
            constexprs["tail"] = None  # as launched when lr is on the host
        signature = {"p_ptr": "*" + param, "g_ptr": "*" + param, "u_ptr": "*fp32",
                     "lg_ptr": "*fp32", "proj_ptr": "*fp32", "tail": "*i64", "M": "i32",
                     "N": "i32", "R": "i32", "decay": "fp32", "step": "fp32", "amp": "*fp32",
                     **{c: "constexpr" for c in constexprs}}
        source = triton.compiler.ASTSource(fn=k._lowrank_step_kernel, signature=signature,
                                           constexprs=constexprs)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": k.NUM_WARPS,
                                      "enable_fp_fusion": False}).asm["ptx"]
        assert not re.search(r"mma[^\\n]*tf32", ptx), f"side {side}: TF32 tensor-core products"
        fmas = len(re.findall(r"fma\\.rn\\.f32", ptx))
        assert 0 < fmas <= dot_fmas, f"side {side}: {fmas} fp32 FMAs, the dots have {dot_fmas}"
        assert not re.search(r"(div|sqrt)\\.(approx|full)\\.f32", ptx), "approximate math"
        print(side, param, "ok")
""")


def test_kernel_compiles_for_h200():
    """Compile for sm_90 with Triton's bundled ptxas (no GPU needed): the products stay
    IEEE fp32 (FMAs, no TF32 tensor cores) and the epilogue gets no FMA contraction."""
    assert compile_for_h200(_COMPILE).count("ok") == 3
