"""The Triton kernels of frugal::linear_cross_entropy under the interpreter.

tests/ops/test_linear_cross_entropy.py runs the op's generic cases on this backend;
here the shapes aim at the kernels' geometry: at most 16 tokens (tiles of 16) and more
(tiles of 64, a ragged last one), vocabularies of one, two and three 64-wide tiles with
a ragged edge (the online softmax's rescaling across tiles), D shorter than, equal to and
longer than a step of 32; the el2n of confident tokens (the stable form of
``1 - p_y``) against float64 logits; and a compile for sm_90 (GPU-only errors, tensor
cores for 16-bit inputs).
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from frugal_kernels import ops, reference

from ..ops.helpers import rel_diff
from .helpers import compile_for_h200, interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("the triton backend needs triton installed", allow_module_level=True)

# (N, D, V)
SHAPES = [(16, 32, 64), (17, 33, 130), (70, 5, 129), (3, 40, 1), (65, 64, 190)]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    yield from interpreted(("_common", "quant_matmul", "linear_cross_entropy"))


def _case(n, d, v, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g)
    weight = torch.randn(v, d, generator=g) / d ** 0.5
    bias = torch.randn(v, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[1::3] = -100
    return hidden, weight, bias, targets


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_tiles_match_the_reference(smoothing):
    for i, (n, d, v) in enumerate(SHAPES):
        hidden, weight, bias, targets = _case(n, d, v, seed=i)
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss, scores = ops.linear_cross_entropy(*leaves[:2], targets, bias=leaves[2],
                                                reduction="sum", label_smoothing=smoothing,
                                                scores=("loss", "el2n"), backend="triton")
        grads = torch.autograd.grad(loss, leaves)
        ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        ref, ref_scores = reference.linear_cross_entropy(
            *ref_leaves[:2], targets, ref_leaves[2], reduction="sum",
            label_smoothing=smoothing, scores=("loss", "el2n"))
        ref_grads = torch.autograd.grad(ref, ref_leaves)
        what = f"{(n, d, v)}"
        assert rel_diff(loss, ref) <= 1e-5, what
        for name in ("loss", "el2n"):
            assert rel_diff(scores[name], ref_scores[name]) <= 1e-5, f"{name} {what}"
        for g, e, name in zip(grads, ref_grads, ("hidden", "weight", "bias")):
            assert rel_diff(g, e) <= 1e-5, f"grad {name} {what}"


def test_el2n_of_confident_tokens_keeps_its_digits():
    """Tokens whose target holds almost all the probability: el2n ~ sqrt(2) (1 - p_y) is
    tiny; 1 - p_y as a difference of fp32 numbers near 1 would keep none of its digits."""
    n, d, v = 20, 16, 150
    hidden, weight, _, _ = _case(n, d, v, seed=7)
    targets = torch.arange(n)
    # Push each target's logit up by 12 to 21 (other tokens' logits of it move too).
    weight = weight.clone()
    for i in range(n):
        weight[i] += (12 + i % 10) * hidden[i] / hidden[i].norm() ** 2
    z = hidden.double() @ weight.double().t()
    p = torch.softmax(z, dim=1)
    p[torch.arange(n), targets] -= 1
    expected = p.norm(dim=1)
    _, scores = ops.linear_cross_entropy(hidden, weight, targets, scores=("el2n",),
                                         backend="triton")
    assert (expected < 1e-4).sum() >= 5, expected
    rel = ((scores["el2n"].double() - expected).abs() / expected).max().item()
    assert rel <= 1e-4, f"el2n relative error {rel:.3g}"


_COMPILE = textwrap.dedent("""
    import re, triton
    from triton.backends.compiler import GPUTarget
    from frugal_kernels.kernels.triton import linear_cross_entropy as k

    for dtype, wide in (("bf16", False), ("fp32", True), ("fp16", False)):
        common = dict(HAS_BIAS=True, WIDE=wide, BLOCK_N=k.BLOCK_N, BLOCK_V=k.BLOCK_V,
                      BLOCK_D=k.BLOCK_D)
        f = dict(h_ptr="*" + dtype, w_ptr="*" + dtype, b_ptr="*" + dtype, t_ptr="*i64",
                 loss_ptr="*fp32", lse_ptr="*fp32", el2n_ptr="*fp32", N="i32", V="i32",
                 D="i32", ignore_index="i32", eps="fp32")
        b = dict(h_ptr="*" + dtype, w_ptr="*" + dtype, b_ptr="*" + dtype, t_ptr="*i64",
                 lse_ptr="*fp32", scale_ptr="*fp32", gh_ptr="*fp32", gw_ptr="*fp32",
                 gb_ptr="*fp32", N="i32", V="i32", D="i32", eps="fp32")
        # The loops' step counts (constexpr, as Triton 3.6's interpreter needs them): a
        # 32,000 x 512 head.
        steps = {k._forward_kernel: dict(V_STEPS=triton.cdiv(32000, k.BLOCK_V),
                                         D_STEPS=triton.cdiv(512, k.BLOCK_D)),
                 k._backward_kernel: dict(D_STEPS=triton.cdiv(512, k.BLOCK_D))}
        for fn, signature in ((k._forward_kernel, f), (k._backward_kernel, b)):
            constexprs = {**common, **steps[fn]}
            signature = {**signature, **{c: "constexpr" for c in constexprs}}
            source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": k.NUM_WARPS}).asm["ptx"]
            if wide:
                assert "tf32" not in ptx, "fp32 products on TF32"
            else:
                assert re.search(r"mma", ptx), f"{dtype}: no tensor-core instruction"
            print(fn.__name__, dtype, "ok")
""")


def test_kernels_compile_for_h200():
    """Compile both kernels for sm_90 with Triton's bundled ptxas (no GPU needed)."""
    assert compile_for_h200(_COMPILE).count("ok") == 6
