"""The Triton kernel of frugal::dqt_update_ under the interpreter: the generator ported
from quant.h, tiles over padded rows, every code width and subset kind, the scalars,
special values, against the C++ cpu backend (codes and moments bit for bit).

tests/ops/test_ops.py runs the op table's samples on this backend against the
reference; here the cases aim at the kernel's own geometry: rows shorter than a
group of eight sharing a tile, rows longer than a tile (BLOCK = 1024 padded
positions) cut at a group boundary, 3-bit fields straddling two bytes, and the
last, partial group of a row.

The module fixture runs the kernel interpreted, as the one of test_kernels.py.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from frugal_kernels import _quant, ops
from frugal_kernels._layout import subset_dim, subset_state_shape

from .helpers import assert_same_bits, compile_for_h200, interpreted, needs_cpu

if importlib.util.find_spec("triton") is None:
    pytest.skip("the triton backend needs triton installed", allow_module_level=True)

HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# The interpreted kernel module, while the fixture holds it: a global, because the
# interpreter runs a kernel with its module's globals and without its closure.
_dqt = None


@pytest.fixture(scope="module", autouse=True)
def kernel():
    global _dqt
    for modules in interpreted(("_common", "adamw", "sign_sgd", "dqt_update")):
        _dqt = modules["dqt_update"]
        yield _dqt
        _dqt = None


# ---------------------------------------------------------------- the generator

EDGES = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0x9E3779B9, 0x61C88646, 0xFFFFFFFE, 0xFFFFFFFF]


def test_generator_is_quant_h_to_the_bit():
    """mix32, rng_key and rng_uniform in uint32 arithmetic against _quant, wrapping
    included: sums past 2**32 (seed + golden ratio, index + key), products that
    overflow, shifts of values with the top bit set (logical, not arithmetic)."""
    import triton
    import triton.language as tl

    @triton.jit
    def generator(x_ptr, y_ptr, mixed_ptr, key_ptr, uniform_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i)
        y = tl.load(y_ptr + i)
        tl.store(mixed_ptr + i, _dqt.mix32(x))
        key = _dqt.rng_key(x, y)
        tl.store(key_ptr + i, key)
        tl.store(uniform_ptr + i, _dqt.rng_uniform(key, y))

    gen = torch.Generator().manual_seed(0)
    xs = EDGES + torch.randint(0, 2**32, (64 - len(EDGES),), generator=gen).tolist()
    ys = list(reversed(xs))
    x = torch.tensor(xs, dtype=torch.int64).to(torch.uint32)
    y = torch.tensor(ys, dtype=torch.int64).to(torch.uint32)
    mixed, key = torch.empty_like(x), torch.empty_like(x)
    uniform = torch.empty(64)
    generator[(1,)](x, y, mixed, key, uniform, N=64)
    assert mixed.to(torch.int64).tolist() == [_quant._mix32_int(v) for v in xs]
    keys = [_quant.rng_key(a, b) for a, b in zip(xs, ys)]
    assert key.to(torch.int64).tolist() == keys
    bits24 = _quant.mix32(torch.tensor(ys) + torch.tensor(keys)) >> 8
    assert torch.equal(uniform, bits24.to(torch.float32) * 2.0**-24)


# ---------------------------------------------------------------- the tiles

# (shape, bits, density) in one call per kind: single elements, rows shorter than
# a group (C = 1, 5) many to a tile, C = 9 (a group and one field, 3 bits: the
# fields straddle bytes and the row ends mid-byte), rows around and past a tile
# (1021, 1024, 2500: tiles start mid-row), empty and full subsets.
CASES = [((1, 1), 3, 1.0), ((300, 5), 3, 0.5), ((700, 1), 2, 0.3), ((37, 9), 3, 0.4),
         ((3, 1021), 4, 0.5), ((2, 1024), 8, 1.0), ((3, 2500), 3, 0.25), ((40, 33), 2, 0.0)]


def dqt_batch(kind, cases, dtype, seed, index_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    lists = [[] for _ in range(6)]
    for i, (shape, bits, density) in enumerate(cases):
        top = _quant.qmax(bits)
        grads = (torch.randn(shape, generator=gen) * 0.3).to(dtype)
        n = subset_dim(grads, kind)
        idx = torch.randperm(n, generator=gen)[:round(n * density)].sort().values.to(index_dtype)
        st = subset_state_shape(grads, kind, idx.numel())
        scales = torch.rand(shape[0] if i % 2 else 1, generator=gen) * 0.02 + 0.01
        q = torch.randint(-top, top + 1, shape, generator=gen)
        for lst, t in zip(lists, (_quant.pack(q, bits), scales, grads,
                                  torch.randn(st, generator=gen) * 0.1,
                                  torch.rand(st, generator=gen) * 0.1, idx)):
            lst.append(t)
    return lists


def run(backend, batch, bits, kind, steps=2, **kw):
    """``steps`` updates of copies of the codes and moments; the gradients, scales and
    indices are shared (read only)."""
    codes, scales, grads, m, v, idx = batch
    codes, m, v = ([t.clone() for t in ts] for ts in (codes, m, v))
    options = dict(HYPER, lr=2e-2, state_free="sign", state_free_scale=0.5, seeds=[7] * len(grads))
    options.update(kw)
    for step in range(1, steps + 1):
        ops.dqt_update_(codes, scales, grads, m, v, idx, bits=bits, kind=kind, step=step,
                        rng_step=2**32 - 3 + step, backend=backend, **options)
    return codes, m, v


def check_against_cpu(kind, cases, dtype, index_dtype=torch.int64, **kw):
    """Each code width in its own call (one width per call), every case of it together."""
    for bits in sorted({b for _, b, _ in cases}):
        chosen = [c for c in cases if c[1] == bits]
        batch = dqt_batch(kind, chosen, dtype, seed=bits, index_dtype=index_dtype)
        before = [t.clone() for t in batch[0]]
        ours = run("triton", batch, bits, kind, **kw)
        theirs = run("cpu", batch, bits, kind, **kw)
        for name, a, e in zip(("codes", "exp_avgs", "exp_avg_sqs"), ours, theirs):
            for i, (x, y) in enumerate(zip(a, e)):
                assert torch.equal(x, y), f"{name}[{i}] ({bits} bits, {kind}): " \
                    f"{int((x != y).sum())} of {x.numel()} differ from the cpu backend"
        moved = [not torch.equal(a, b) for a, b in zip(ours[0], before) if a.numel() > 4]
        assert all(moved), "a weight kept all its codes"


@needs_cpu
@pytest.mark.parametrize("kind", ["rows", "columns", "flat"])
def test_tiles_against_cpu(kind):
    check_against_cpu(kind, CASES, torch.float32)


@needs_cpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["rows", "columns"])
def test_16bit_gradients_and_int32_indices(kind, dtype):
    cases = [((300, 5), 3, 0.5), ((3, 2500), 4, 0.25), ((37, 9), 2, 0.4)]
    check_against_cpu(kind, cases, dtype, index_dtype=torch.int32, state_free="sgd")


@needs_cpu
@pytest.mark.parametrize("beta1", [0.9, 0.0])
def test_scalars_in_kernel(kernel, beta1):
    """lr and step read by the kernel and the scalars derived there in fp64 (the path of
    lr / step on a GPU): the bits of the cpu backend's host derivation."""
    batch = dqt_batch("columns", [((37, 9), 3, 0.4), ((3, 2500), 3, 0.25)], torch.float32, 3)
    for step in (1, 7, 1000):
        lr, step_t = torch.tensor(3e-3, dtype=torch.float32), torch.tensor(step)
        hyper = dict(HYPER, beta1=beta1, lr=lr, step=step_t, state_free="sgd",
                     state_free_scale=0.5, seeds=[5, 6], bits=3, kind="columns",
                     rng_step=step)
        ours = [[t.clone() for t in batch[i]] for i in (0, 3, 4)]
        kernel.dqt_update_(ours[0], batch[1], batch[2], ours[1], ours[2], batch[5],
                           scalars_in_kernel=True, **hyper)
        theirs = [[t.clone() for t in batch[i]] for i in (0, 3, 4)]
        ops.dqt_update_(theirs[0], batch[1], batch[2], theirs[1], theirs[2], batch[5],
                        backend="cpu", **hyper)
        for name, a, e in zip(("codes", "exp_avgs", "exp_avg_sqs"), ours, theirs):
            for i, (x, y) in enumerate(zip(a, e)):
                assert torch.equal(x, y), f"{name}[{i}] at step {step}"


@needs_cpu
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_special_values():
    """NaN and infinite gradients, weights pushed past the code range: the cpu backend's
    codes (NaN to the code 0, clamped to +-qmax) and moments."""
    nan, inf = float("nan"), float("inf")
    g = torch.tensor([[nan, inf, -inf, 0.0, -0.0, 1e-40, 3e38, -3e38, 1.0, -2.0, 5.0, nan]])
    codes = _quant.pack(torch.tensor([[1, -1, 0, 1, -1, 0, 1, -1, 1, 0, -1, 1]]), 2)
    idx = torch.tensor([0, 1, 2, 6, 9])
    outs = {}
    for backend in ("triton", "cpu"):
        out = [codes.clone()], [torch.zeros(5)], [torch.zeros(5)]
        ops.dqt_update_(out[0], [torch.tensor([0.01])], [g], out[1], out[2], [idx], bits=2,
                        kind="flat", seeds=[1], lr=0.5, step=1, rng_step=3, backend=backend,
                        **HYPER)
        outs[backend] = out
    assert torch.equal(outs["triton"][0][0], outs["cpu"][0][0]), "codes"
    for name, a, e in zip(("exp_avgs", "exp_avg_sqs"), outs["triton"][1:], outs["cpu"][1:]):
        assert_same_bits(a, e, name)


def test_steps_past_the_range_clamp():
    """A step far larger than the scale clamps every code to the end of its range."""
    g = torch.tensor([[1.0, -1.0, 2.0, -3.0, 0.5]])
    codes = [_quant.pack(torch.zeros(1, 5, dtype=torch.int64), 4)]
    ops.dqt_update_(codes, [torch.tensor([1e-3])], [g], [torch.zeros(0)], [torch.zeros(0)],
                    [torch.zeros(0, dtype=torch.int64)], bits=4, kind="flat", seeds=[0], lr=1.0,
                    step=1, rng_step=0, backend="triton", **HYPER)
    assert _quant.unpack(codes[0], 4, 5).tolist() == [[-7, 7, -7, 7, -7]]


# ---------------------------------------------------------------- GPU code, without a GPU

_COMPILE = textwrap.dedent("""
    import re, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from frugal_kernels.kernels.triton import dqt_update as k

    SCALARS = ["decay", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size", "bc2_sqrt",
               "eps", "sf_step"]
    for bits, g_dtype, columns, in_kernel in ((3, tl.bfloat16, True, True),
                                              (4, tl.float32, False, False)):
        constexprs = dict(G_DTYPE=g_dtype, AMP=in_kernel, INDEX_DTYPE=tl.int32, COLUMNS=columns,
                          STATE_FREE=0, BITS=bits, SCALARS_IN_KERNEL=in_kernel, BLOCK=k.BLOCK)
        signature = {"table": "*i64", "n_tensors": "i32", **{f: "fp32" for f in SCALARS},
                     "rng_step": "u32", "amp": "*fp32", **{c: "constexpr" for c in constexprs}}
        source = triton.compiler.ASTSource(fn=k._dqt_update_kernel, signature=signature,
                                           constexprs=constexprs)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": k.NUM_WARPS,
                                      "enable_fp_fusion": False}).asm["ptx"]
        assert not re.search(r"fma\\.rn\\.f32", ptx), f"{bits} bits: fp32 FMA contraction"
        assert not re.search(r"(div|sqrt)\\.(approx|full)\\.f32", ptx), "approximate math"
        print(bits, "ok")
""")


def test_kernel_compiles_for_h200():
    """Compile for sm_90 with Triton's bundled ptxas (no GPU needed): the interpreter does
    not see GPU-only errors; IEEE division and square root, no FMA contraction."""
    assert compile_for_h200(_COMPILE).count("ok") == 2
