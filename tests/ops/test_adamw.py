"""frugal::adamw_ on every backend usable on the CPU, against the reference and torch.optim.AdamW."""

import re

import pytest
import torch

from frugal_kernels import ops, reference
from frugal_kernels._extension import extension

from .helpers import (DTYPES, assert_params_close, clone, cpu_backends, make_batch, rel_diff)

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
SIZES = [1, 7, 4097, 2**20 + 3]


def run_both(backend, batch, steps=1, **kw):
    """Step a copy of the batch with the backend and a copy with the reference."""
    hyper = {**HYPER, **kw}
    fast, ref = [clone(t) for t in batch], [clone(t) for t in batch]
    for step in range(1, steps + 1):
        grads = fast[1]
        ops.adamw_(fast[0], grads, fast[2], fast[3], step=step, backend=backend, **hyper)
        reference.adamw_(ref[0], grads, ref[2], ref[3], step=step, **hyper)
    return fast, ref


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_matches_reference(backend, dtype, size):
    if backend == "triton" and size > 2**16:
        size = 2**16 + 3  # the interpreter is slow; the largest size adds no new path there
    batch = make_batch([size], dtype, seed=size)
    fast, ref = run_both(backend, batch, steps=3)
    assert_params_close(fast[0], ref[0])
    assert_params_close(fast[2], ref[2], what="exp_avgs")
    assert_params_close(fast[3], ref[3], what="exp_avg_sqs")


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_sizes_and_empty_tensors_in_one_call(backend, dtype):
    batch = make_batch([5, 0, 1000, 1, (3, 0), (33, 65), 4096], dtype, seed=1)
    fast, ref = run_both(backend, batch, steps=10, maximize=True)
    assert_params_close(fast[0], ref[0])
    assert_params_close(fast[2], ref[2], what="exp_avgs")
    assert_params_close(fast[3], ref[3], what="exp_avg_sqs")


@pytest.mark.parametrize("backend", cpu_backends())
def test_matches_torch_adamw_over_50_steps(backend):
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 33), (17,), (1,), (4099,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(50)]
    hyper = dict(lr=3e-3, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.1)

    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    opt = torch.optim.AdamW(theirs, foreach=False, **hyper)
    ours = [t.clone() for t in init]
    m = [torch.zeros_like(t) for t in init]
    v = [torch.zeros_like(t) for t in init]
    for step, g in enumerate(grads, start=1):
        for p, gi in zip(theirs, g):
            p.grad = gi
        opt.step()
        ops.adamw_(ours, g, m, v, lr=hyper["lr"], beta1=0.85, beta2=0.98, eps=1e-7,
                   weight_decay=0.1, step=step, backend=backend)
    for i, p in enumerate(theirs):
        state = opt.state[p]
        assert rel_diff(ours[i], p.detach()) <= 1e-6, f"param {i}"
        assert rel_diff(m[i], state["exp_avg"]) <= 1e-6, f"exp_avg {i}"
        assert rel_diff(v[i], state["exp_avg_sq"]) <= 1e-6, f"exp_avg_sq {i}"


@pytest.mark.parametrize("backend", cpu_backends())
def test_tensor_lr_and_step(backend):
    batch = make_batch([300, 5], torch.float32, seed=2)
    a, b = [clone(t) for t in batch], [clone(t) for t in batch]
    ops.adamw_(*a, **{**HYPER, "lr": 2e-3}, step=4, backend=backend)
    ops.adamw_(*b, **{**HYPER, "lr": torch.tensor(2e-3)}, step=torch.tensor(4.0),
               backend=backend)
    for x, y in zip(a[0] + a[2] + a[3], b[0] + b[2] + b[3]):
        assert torch.equal(x, y)


@pytest.mark.skipif(extension() is None, reason="compiled extension not built")
def test_every_cpu_isa_level_gives_identical_bits():
    ext = extension()
    levels = ext.build_info()["cpu_isa_levels"]
    results = []
    try:
        for level in levels:
            if not ext.cpu_select_isa(level):
                continue  # built but this CPU lacks it
            for dtype in DTYPES:
                batch = make_batch([1, 31, 4097], dtype, seed=3)
                ops.adamw_(*batch, **HYPER, step=7, backend="cpu")
                results.append((level, dtype, batch))
    finally:
        ext.cpu_select_isa("auto")
    by_dtype = {}
    for level, dtype, batch in results:
        by_dtype.setdefault(dtype, []).append((level, batch))
    for dtype, runs in by_dtype.items():
        (base_level, base), *others = runs
        for level, batch in others:
            for x, y in zip(sum(base, []), sum(batch, [])):
                assert torch.equal(x, y), f"{level} differs from {base_level} for {dtype}"


def _fresh():
    return make_batch([10, 6], torch.float32, seed=4)


def _bad_inputs():
    p, g, m, v = _fresh()
    yield "length", (p, g[:1], m, v), {}, ValueError, "1 grads"
    p, g, m, v = _fresh()
    yield "grad dtype", (p, [g[0].double(), g[1]], m, v), {}, TypeError, "grads[0] has dtype"
    p, g, m, v = _fresh()
    yield "param dtype", ([p[0], p[1].half()], [g[0], g[1].half()], m, v), {}, TypeError, \
        "params[1] has dtype"
    p, g, m, v = _fresh()
    yield "int params", ([x.long() for x in p], [x.long() for x in g], m, v), {}, TypeError, \
        "supported dtypes"
    p, g, m, v = _fresh()
    yield "state dtype", (p, g, [m[0].double(), m[1]], v), {}, TypeError, "exp_avgs[0]"
    p, g, m, v = _fresh()
    yield "grad shape", (p, [g[0], g[1][:3]], m, v), {}, ValueError, "grads[1] has shape"
    p, g, m, v = _fresh()
    yield "state shape", (p, g, m, [v[0], v[1][:2]]), {}, ValueError, "exp_avg_sqs[1] has shape"
    p, g, m, v = _fresh()
    big = torch.randn(6, 4)
    yield "non-contiguous param", ([p[0], big.t()], [g[0], torch.randn(4, 6)], m,
                                   [v[0], torch.zeros(4, 6)]), {}, ValueError, "not contiguous"
    p, g, m, v = _fresh()
    yield "device", (p, [g[0], g[1].to("meta")], m, v), {}, ValueError, "is on meta"
    p, g, m, v = _fresh()
    yield "step 0", (p, g, m, v), {"step": 0}, ValueError, "step counts updates from 1"
    p, g, m, v = _fresh()
    yield "beta", (p, g, m, v), {"beta1": 1.0}, ValueError, "beta1"
    p, g, m, v = _fresh()
    yield "lr shape", (p, g, m, v), {"lr": torch.ones(2)}, ValueError, "lr must be"
    p, g, m, v = _fresh()
    yield "backend", (p, g, m, v), {"backend": "nope"}, ValueError, "unknown backend"


@pytest.mark.parametrize("case", list(_bad_inputs()), ids=lambda c: c[0])
def test_bad_input_raises_and_leaves_tensors_untouched(case):
    _, args, overrides, error, message = case
    before = [[t.clone() for t in lst] for lst in args]
    kwargs = {**HYPER, "step": 1, **overrides}
    with pytest.raises(error, match=re.escape(message)):
        ops.adamw_(*args, **kwargs)
    for lst, saved in zip(args, before):
        for t, s in zip(lst, saved):
            if t.device.type != "meta":
                assert torch.equal(t, s)


def test_opcheck():
    p, g, m, v = make_batch([33, 4], torch.float32, seed=5)
    torch.library.opcheck(torch.ops.frugal.adamw_.default,
                          (p, g, m, v, torch.tensor(1e-3), 0.9, 0.999, 1e-8, 0.01,
                           torch.tensor(3.0), False, "auto"))
