"""The triton backend of every op against the reference (torch) and the C++ cpu backend.

The kernels run on CPU tensors under the Triton interpreter: a fixture of this
module sets TRITON_INTERPRET=1 for its tests and (re)imports the kernel modules
under it, and restores both afterwards. tests/conftest.py already sets the
variable for whole sessions without CUDA; on a GPU machine the fixture keeps
the rest of the session (GPU tests, torch.compile) on compiled Triton, which
is also why it imports triton itself before setting the variable.
They follow csrc/include/frugal/update_rules.h operation for operation, so they
must equal the cpu backend bit for bit, in every dtype; against the torch
reference (whose lerp / addcmul may fuse multiply-adds) fp32 results agree to
1e-6 relative and 16-bit parameters to one unit in the last place.
"""

from __future__ import annotations

import importlib
import importlib.util
import textwrap

import pytest
import torch

from frugal_kernels import ops, reference
from frugal_kernels._layout import subset_dim
from frugal_kernels._layout import subset_state_shape as state_shape

from .helpers import (assert_near_reference, assert_same_bits, compile_for_h200,
                      cpu_backend_available, interpreted, needs_cpu)

if importlib.util.find_spec("triton") is None:
    pytest.skip("the triton backend needs triton installed", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 7, 4097, 0, 20_000]  # in one call: mixed sizes, an empty tensor, partial tiles
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    yield from interpreted(("_common", "adamw", "adamw_int8", "sign_sgd", "sgd", "frugal_step"))


def clone(state):
    return tuple([t.clone() for t in tensors] for tensors in state)


def check_steps(state, make_grads, update, steps=3, names=("params", "exp_avgs", "exp_avg_sqs")):
    """Update ``state`` (lists of params and moments) ``steps`` times on the triton backend.

    Each step is compared with the reference run from the same inputs, so the
    tolerance holds per store (over several steps, a 16-bit parameter one ulp
    apart can drift to a smaller magnitude where that gap is many ulps); the
    whole trajectory is compared with the cpu backend's, bit for bit.
    """
    start = clone(state)
    cpu = clone(state) if cpu_backend_available() else None
    for step in range(1, steps + 1):
        grads = make_grads()
        reference = clone(state)
        update(state, grads, "triton", step)
        update(reference, grads, "torch", step)
        for name, ours, theirs in zip(names, state, reference):
            assert_near_reference(ours, theirs, f"{name} vs torch at step {step}")
        if cpu is not None:
            update(cpu, grads, "cpu", step)
            for name, ours, theirs in zip(names, state, cpu):
                assert_same_bits(ours, theirs, f"{name} vs cpu at step {step}")
    moved = [not torch.equal(a, b) for a, b in zip(state[0], start[0]) if a.numel() > 0]
    assert any(moved), "no parameter changed"


def randn(shape, dtype, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def scalar(value, step: int, dtype=torch.float64):
    """lr / step as a number on odd steps and as a 0-dim tensor on even ones."""
    return torch.tensor(value, dtype=dtype) if step % 2 == 0 else value


# ---------------------------------------------------------------- adamw_

@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adamw(dtype, maximize):
    sizes = SIZES if not maximize else [4097, 3]
    gen = torch.Generator().manual_seed(0)
    state = ([randn(n, dtype, gen) for n in sizes], [torch.zeros(n) for n in sizes],
             [torch.zeros(n) for n in sizes])

    def update(state, grads, backend, step):
        ops.adamw_(*state[:1], grads, *state[1:], lr=scalar(3e-2, step),
                   step=scalar(step, step, torch.int64), maximize=maximize, backend=backend,
                   **HYPER)

    check_steps(state, lambda: [randn(n, dtype, gen) for n in sizes], update)


# ---------------------------------------------------------------- sign_sgd_

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sign_sgd(dtype):
    gen = torch.Generator().manual_seed(0)

    def make_grads():
        grads = [randn(n, dtype, gen) for n in SIZES]
        grads[1][::2] = 0.0  # sign(0) = 0: no step
        return grads

    def update(state, grads, backend, step):
        ops.sign_sgd_(state[0], grads, lr=scalar(1e-2, step), weight_decay=0.1, scale=0.5,
                      backend=backend)

    check_steps(([randn(n, dtype, gen) for n in SIZES],), make_grads, update)


# ---------------------------------------------------------------- sgd_

SGD_OPTIONS = {
    "momentum": dict(momentum=0.9, dampening=0.2, weight_decay=0.1),
    "nesterov, maximize": dict(momentum=0.8, nesterov=True, maximize=True, weight_decay=0.01),
    "no momentum": dict(weight_decay=0.1),
}


@pytest.mark.parametrize("options", list(SGD_OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sgd(dtype, options):
    gen = torch.Generator().manual_seed(0)
    hyper = SGD_OPTIONS[options]
    with_buffers = "momentum" in hyper

    def update(state, grads, backend, step):
        ops.sgd_(state[0], grads, state[1], lr=scalar(1e-2, step), first_step=step == 1,
                 backend=backend, **hyper)

    # The buffers start as NaN: the first step must overwrite them unread.
    buffers = [torch.full((n,), float("nan")) for n in SIZES] if with_buffers else []
    check_steps(([randn(n, dtype, gen) for n in SIZES], buffers),
                lambda: [randn(n, dtype, gen) for n in SIZES], update,
                names=("params", "momentum_buffers"))


# ---------------------------------------------------------------- frugal_step_

# (shape, density) per kind: single coordinates, rows and columns cut at either
# end by tile bounds (BLOCK 2048), rows longer than a tile, a 3-D tensor, an
# empty tensor, and empty, partial and full subsets, all in one call.
FRUGAL_CASES = {
    "rows": [((1,), 1.0), ((3, 5), 0.0), ((700, 7), 0.5), ((3, 2500), 0.67), ((2, 3, 50), 0.5),
             ((0, 4), 0.0), ((4097,), 0.3), ((64, 300), 0.3), ((9, 500), 1.0)],
    "columns": [((1,), 0.0), ((3, 5), 1.0), ((700, 7), 0.43), ((3, 2500), 0.5),
                ((2, 3, 50), 0.1), ((0, 4), 0.5), ((4097,), 0.3), ((64, 300), 0.05)],
    "flat": [((1,), 1.0), ((3, 5), 0.0), ((700, 7), 0.5), ((2, 3, 50), 0.1), ((0,), 0.0),
             ((4097,), 0.99), ((19_200,), 0.3)],
}


def check_frugal(kind, dtype, index_dtype, state_free):
    gen = torch.Generator().manual_seed(0)
    shapes = [shape for shape, _ in FRUGAL_CASES[kind]]
    params = [randn(s, dtype, gen) for s in shapes]
    indices = []
    for p, (_, density) in zip(params, FRUGAL_CASES[kind]):
        n = subset_dim(p, kind)
        k = round(n * density)
        indices.append(torch.randperm(n, generator=gen)[:k].sort().values.to(index_dtype))
    exp_avgs = [torch.zeros(state_shape(p, kind, idx.numel())) for p, idx in zip(params, indices)]

    def update(state, grads, backend, step):
        ops.frugal_step_(*state[:1], grads, *state[1:], indices, kind=kind,
                         lr=scalar(2e-2, step), step=scalar(step, step, torch.int64),
                         state_free=state_free, state_free_scale=0.5, backend=backend, **HYPER)

    check_steps((params, exp_avgs, [torch.zeros_like(m) for m in exp_avgs]),
                lambda: [randn(s, dtype, gen) for s in shapes], update)


# Every kind sees both index dtypes and the three state-free rules (the full
# product would double the time under the interpreter for no new code path).
@pytest.mark.parametrize("index_dtype, state_free", [
    (torch.int32, "sign"), (torch.int64, "sign"), (torch.int64, "sgd"), (torch.int32, "none")],
    ids=str)
@pytest.mark.parametrize("kind", ["rows", "columns", "flat"])
def test_frugal_step(kind, index_dtype, state_free):
    check_frugal(kind, torch.float32, index_dtype, state_free)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["rows", "columns", "flat"])
def test_frugal_step_16bit(kind, dtype):
    check_frugal(kind, dtype, torch.int64, "sign")


def test_frugal_step_updates_both_parts():
    """Member rows move by AdamW, the other rows by the state-free step."""
    p = torch.zeros(4, 3)
    g = torch.ones(4, 3)
    m, v = torch.zeros(2, 3), torch.zeros(2, 3)
    ops.frugal_step_([p], [g], [m], [v], [torch.tensor([0, 2])], kind="rows", lr=0.1,
                     state_free="sign", state_free_scale=0.5, step=1, backend="triton", **HYPER)
    torch.testing.assert_close(p[[0, 2]], torch.full((2, 3), -0.1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p[[1, 3]], torch.full((2, 3), -0.05))
    torch.testing.assert_close(m, torch.full((2, 3), 0.1))


def test_sign_trajectory():
    """Gradients that depend on the parameters: a flipped sign would compound, so the
    trajectories are compared by the fraction of coordinates that differ (DESIGN.md 6)."""
    def run(backend):
        gen = torch.Generator().manual_seed(3)
        p = [torch.randn(64, 50, generator=gen)]
        target = torch.randn(64, 50, generator=gen)
        idx = [torch.randperm(50, generator=gen)[:12].sort().values]
        m, v = [torch.zeros(64, 12)], [torch.zeros(64, 12)]
        for step in range(1, 21):
            ops.frugal_step_(p, [p[0] - target], m, v, idx, kind="columns", lr=1e-2, step=step,
                             state_free="sign", state_free_scale=1.0, backend=backend, **HYPER)
        return p[0]

    ours = run("triton")
    differ = float(((ours - run("torch")).abs() > 1e-5).float().mean())
    assert differ <= 0.01, f"{differ:.2%} of the coordinates left the reference trajectory"
    if cpu_backend_available():
        assert_same_bits([ours], [run("cpu")], "params vs cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@needs_cpu
def test_special_values(dtype):
    """NaN, infinities, signed zeros, subnormals and overflow give the cpu backend's bits."""
    nan, inf = float("nan"), float("inf")
    p0 = torch.tensor([0.0, -0.0, 1.0, -1.0, 3e38, -3e38, 1e-40, -1e-40, 6e4, 2.0, 0.5, 1e-3])
    g = torch.tensor([nan, inf, -inf, 0.0, -0.0, 1e-40, 3e38, -1e-3, 1.0, nan, 1e-39, -2.0])
    g = g.to(dtype)
    outs = {}
    for backend in ("triton", "cpu"):
        p, q, r = (p0.to(dtype) for _ in range(3))
        m, v, fm, fv = torch.zeros(12), torch.zeros(12), torch.zeros(4), torch.zeros(4)
        ops.adamw_([p], [g], [m], [v], lr=1e-2, step=1, backend=backend, **HYPER)
        ops.sign_sgd_([q], [g], lr=1e-2, weight_decay=0.1, backend=backend)
        ops.frugal_step_([r], [g], [fm], [fv], [torch.tensor([0, 1, 5, 9])], kind="flat", lr=1e-2,
                         step=1, state_free="sgd", backend=backend, **HYPER)
        outs[backend] = (p, m, v, q, r, fm, fv)
    for name, a, b in zip(("adamw p", "m", "v", "sign_sgd p", "frugal p", "frugal m",
                           "frugal v"), outs["triton"], outs["cpu"]):
        assert_same_bits([a], [b], name)


# ---------------------------------------------------------------- scalars read by the kernel

@needs_cpu
@pytest.mark.parametrize("beta1", [0.9, 0.0])
def test_scalars_in_kernel(kernels, beta1):
    """The device-scalar path (lr / step read and the scalars derived in the kernel, in
    fp64) gives the bits of the host derivation of the cpu backend."""
    lr = torch.tensor(3e-3, dtype=torch.float32)
    hyper = dict(HYPER, beta1=beta1)
    gen = torch.Generator().manual_seed(5)
    shapes = [(5, 300), (3,), (4100,)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    idx = [torch.tensor([1, 3]), torch.tensor([2]), torch.arange(0, 4100, 7)]
    for step in (1, 7, 1000):
        step_t = torch.tensor(step)
        outs = {}
        for how in ("kernel", "cpu"):
            p = [t.clone() for t in start]
            q = [t.clone() for t in start]
            r = [t.clone() for t in start]
            m = [torch.full(s, 0.1) for s in shapes]
            v = [torch.full(s, 0.2) for s in shapes]
            fm = [torch.full(state_shape(t, "rows", i.numel()), 0.1) for t, i in zip(r, idx)]
            fv = [torch.full_like(t, 0.2) for t in fm]
            sp = [t.clone() for t in start]
            sb = [torch.full(s, 0.3) for s in shapes]
            sgd = dict(momentum=0.9, dampening=0.1, weight_decay=0.1)
            if how == "kernel":
                kernels["sgd"].sgd_(sp, grads, sb, lr=lr, nesterov=False, maximize=False,
                                    first_step=step == 1, scalars_in_kernel=True, **sgd)
                kernels["adamw"].adamw_(p, grads, m, v, lr=lr, step=step_t, maximize=False,
                                        scalars_in_kernel=True, **hyper)
                kernels["sign_sgd"].sign_sgd_(q, grads, lr=lr, weight_decay=0.1, scale=0.5,
                                              scalars_in_kernel=True)
                kernels["frugal_step"].frugal_step_(
                    r, grads, fm, fv, idx, kind="rows", lr=lr, step=step_t, state_free="sgd",
                    state_free_scale=0.5, scalars_in_kernel=True, **hyper)
            else:
                ops.adamw_(p, grads, m, v, lr=lr, step=step_t, backend="cpu", **hyper)
                ops.sign_sgd_(q, grads, lr=lr, weight_decay=0.1, scale=0.5, backend="cpu")
                ops.frugal_step_(r, grads, fm, fv, idx, kind="rows", lr=lr, step=step_t,
                                 state_free="sgd", state_free_scale=0.5, backend="cpu", **hyper)
                ops.sgd_(sp, grads, sb, lr=lr, first_step=step == 1, backend="cpu", **sgd)
            outs[how] = (p, m, v, q, r, fm, fv, sp, sb)
        for name, a, b in zip(("adamw p", "m", "v", "sign_sgd p", "frugal p", "frugal m",
                               "frugal v", "sgd p", "sgd buffer"), outs["kernel"], outs["cpu"]):
            assert_same_bits(a, b, f"{name} at step {step}")


# ---------------------------------------------------------------- layouts

def test_unaligned_and_non_contiguous():
    """Tensors carved out of one buffer at odd offsets (no vector loads) and a
    non-contiguous gradient, which the op makes contiguous."""
    def run(backend):
        buf = torch.arange(12_000, dtype=torch.float32).div_(1000.0).sin_()
        params = [buf[1:4098], buf[4099:4106], buf[5001:11_001]]
        grads = [t.flip(0).cos() for t in params]
        grads[2] = torch.linspace(-1.0, 1.0, 12_000)[::2]
        assert not grads[2].is_contiguous()
        states = [[torch.zeros(t.numel()) for t in params] for _ in range(2)]
        ops.adamw_(params, grads, *states, lr=1e-2, step=1, backend=backend, **HYPER)
        ops.sign_sgd_(params, grads, lr=1e-2, backend=backend)
        return params

    expected = run("cpu" if cpu_backend_available() else "torch")
    actual = run("triton")
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="not contiguous"):
        p = torch.zeros(4, 4).t()
        ops.sign_sgd_([p], [torch.ones(4, 4)], lr=0.1, backend="triton")


def test_interpreter_refuses_device_tensors(kernels):
    """Under the interpreter the table's addresses are read on the host."""
    p = torch.zeros(4, device="meta")
    with pytest.raises(ValueError, match="CPU tensors only"):
        kernels["sign_sgd"].sign_sgd_([p], [p], lr=torch.tensor(0.1), weight_decay=0.0,
                                      scale=1.0)


# ---------------------------------------------------------------- GPU code, without a GPU

_COMPILE = textwrap.dedent("""
    import re, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from frugal_kernels.kernels.triton import adamw, adamw_int8, sign_sgd, frugal_step

    ADAMW = ["decay", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size", "bc2_sqrt",
             "eps"]
    CASES = [
        (adamw._adamw_kernel, ADAMW, dict(P_DTYPE=tl.float32, MAXIMIZE=False, AMP=True,
                                          SCALARS_IN_KERNEL=False, ALIGNED=True,
                                          BLOCK=adamw.BLOCK), adamw.NUM_WARPS),
        (sign_sgd._sign_sgd_kernel, ["decay", "step"], dict(
            P_DTYPE=tl.bfloat16, AMP=False, SCALARS_IN_KERNEL=True, ALIGNED=True,
            BLOCK=sign_sgd.BLOCK),
         sign_sgd.NUM_WARPS),
        (frugal_step._frugal_step_kernel, ADAMW + ["sf_step"], dict(
            P_DTYPE=tl.float32, AMP=True, INDEX_DTYPE=tl.int32, COLUMNS=True, STATE_FREE=0,
            SCALARS_IN_KERNEL=True, ALIGNED=True, BLOCK=frugal_step.BLOCK),
         frugal_step.NUM_WARPS),
        (frugal_step._frugal_step_kernel, ADAMW + ["sf_step"], dict(
            P_DTYPE=tl.float16, AMP=False, INDEX_DTYPE=tl.int64, COLUMNS=False, STATE_FREE=1,
            SCALARS_IN_KERNEL=False, ALIGNED=False, BLOCK=frugal_step.BLOCK),
         frugal_step.NUM_WARPS),
        (adamw_int8._adamw_int8_kernel, ADAMW, dict(
            P_DTYPE=tl.bfloat16, MAXIMIZE=True, AMP=True, SCALARS_IN_KERNEL=True,
            NB=adamw_int8.NB, BLOCK=256), adamw_int8.NUM_WARPS),
    ]
    for fn, floats, constexprs, num_warps in CASES:
        # amp: GradScaler's (inverse scale, found_inf) pair, read when AMP is set.
        signature = {"table": "*i64", "n_tensors": "i32", **{f: "fp32" for f in floats},
                     "amp": "*fp32", **{c: "constexpr" for c in constexprs}}
        source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": num_warps, "enable_fp_fusion": False}).asm["ptx"]
        name = fn.__name__
        assert not re.search(r"fma\\.rn\\.f32", ptx), f"{name}: fp32 FMA contraction"
        assert not re.search(r"(div|sqrt)\\.(approx|full)\\.f32", ptx), f"{name}: approximate math"
        if constexprs.get("ALIGNED"):
            assert re.search(r"ld\\.global(\\.\\w+)*\\.v4", ptx), f"{name}: no 16-byte loads"
        print(name, "ok")
""")


def test_kernels_compile_for_h200():
    """Compile the kernels for sm_90 with Triton's bundled ptxas (no GPU needed): the
    interpreter does not see GPU-only errors, contraction into FMA or approximate math."""
    assert compile_for_h200(_COMPILE).count("ok") == 5


@needs_cpu
def test_adamw_int8_scalars_in_kernel_and_grad_scaler(kernels):
    """adamw_int8_'s device-scalar path and its GradScaler tensors (an inf found leaves
    every code, scale and param as it was) give the cpu backend's bits."""
    gen = torch.Generator().manual_seed(6)
    shapes = [(5, 300), (3,), (2, 4100)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    moments = [(*reference.quantize_moment(torch.randn(s, generator=gen) * 0.1, False),
                *reference.quantize_moment(torch.rand(s, generator=gen) * 0.01, True))
               for s in shapes]
    lr = torch.tensor(3e-3)
    for step, found in ((1, 0.0), (7, 1.0), (1000, 0.0)):
        amp = dict(grad_scale=torch.tensor(8.0), found_inf=torch.tensor([found]))
        outs = {}
        for how in ("kernel", "cpu"):
            p = [t.clone() for t in start]
            lists = [[m[k].clone() for m in moments] for k in range(4)]
            if how == "kernel":
                kernels["adamw_int8"].adamw_int8_(p, [g * 8 for g in grads], *lists, lr=lr,
                                                  step=torch.tensor(step), maximize=True,
                                                  scalars_in_kernel=True, **HYPER, **amp)
            else:
                ops.adamw_int8_(p, [g * 8 for g in grads], *lists, lr=lr, step=step,
                                maximize=True, backend="cpu", **HYPER, **amp)
            outs[how] = (p, *lists)
        for name, a, b in zip(("params", "m", "m scales", "v", "v scales"), outs["kernel"],
                              outs["cpu"]):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"{name} at step {step}"
        if found:
            assert all(torch.equal(x, y) for x, y in zip(outs["cpu"][0], start))
