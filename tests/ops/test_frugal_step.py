"""frugal::frugal_step_ on every backend usable on the CPU, against the reference."""

import re

import pytest
import torch

from frugal_kernels import ops, reference
from frugal_kernels._extension import extension
from frugal_kernels._layout import subset_dim
from frugal_kernels._layout import subset_state_shape as state_shape

from .helpers import DTYPES, assert_params_close, clone, cpu_backends, make_batch

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)

# (kind, shape): rows of many lengths (the CPU walks long rows in place and
# gathers rows of length 1), columns narrower and wider than a CPU block of
# 2048, flat lists over 1-D and 3-D tensors.
CASES = [
    ("rows", (37, 130)),
    ("rows", (8192, 3)),
    ("rows", (4097,)),
    ("rows", (5, 3, 7)),
    ("columns", (37, 130)),
    ("columns", (5, 5000)),
    ("columns", (3, 4, 50)),
    ("flat", (4097,)),
    ("flat", (60, 70)),
]


def subset(shape, kind, density, seed, dtype=torch.int64):
    n = subset_dim(torch.empty(shape, device="meta"), kind)
    gen = torch.Generator().manual_seed(seed)
    k = round(density * n)
    return torch.randperm(n, generator=gen)[:k].sort().values.to(dtype)


def make_case(kind, shape, dtype, density, seed, index_dtype=torch.int64):
    idx = subset(shape, kind, density, seed, index_dtype)
    p = torch.empty(shape, device="meta")
    st = state_shape(p, kind, idx.numel())
    params, grads, m, v = make_batch([shape], dtype, seed=seed, state_shapes=[st])
    return params, grads, m, v, [idx]


def step_both(backend, case, kind, steps=2, **kw):
    hyper = {**HYPER, **kw}
    params, grads, m, v, idx = case
    fast = [clone(params), clone(m), clone(v)]
    ref = [clone(params), clone(m), clone(v)]
    for step in range(1, steps + 1):
        ops.frugal_step_(fast[0], grads, fast[1], fast[2], idx, kind=kind, step=step,
                         backend=backend, **hyper)
        reference.frugal_step_(ref[0], grads, ref[1], ref[2], idx, kind=kind, step=step,
                               **hyper)
    return fast, ref


def assert_same_update(fast, ref):
    assert_params_close(fast[0], ref[0])
    assert_params_close(fast[1], ref[1], what="exp_avgs")
    assert_params_close(fast[2], ref[2], what="exp_avg_sqs")


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,shape", CASES, ids=lambda x: str(x))
def test_matches_reference(backend, dtype, kind, shape):
    case = make_case(kind, shape, dtype, density=0.25, seed=sum(shape))
    assert_same_update(*step_both(backend, case, kind))


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("kind", ["rows", "columns", "flat"])
@pytest.mark.parametrize("density", [0.0, 1.0, 0.6])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_densities_and_index_dtypes(backend, kind, density, index_dtype):
    case = make_case(kind, (33, 70), torch.float32, density, seed=7, index_dtype=index_dtype)
    assert_same_update(*step_both(backend, case, kind))


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("state_free", ["sign", "sgd", "none"])
@pytest.mark.parametrize("kind", ["rows", "columns", "flat"])
def test_state_free_rules(backend, state_free, kind):
    case = make_case(kind, (40, 50), torch.float32, 0.3, seed=8)
    assert_same_update(*step_both(backend, case, kind, state_free=state_free,
                                  state_free_scale=0.25))


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("kind", ["rows", "columns", "flat"])
def test_large_tensor(backend, kind):
    shape = (1031, 1017) if backend != "triton" else (131, 517)  # 2^20 + 3 elements on cpu
    case = make_case(kind, shape, torch.float32, 0.25, seed=9)
    assert_same_update(*step_both(backend, case, kind, steps=1))


@pytest.mark.parametrize("backend", cpu_backends())
def test_many_tensors_mixed_sizes_and_empty(backend):
    shapes = [(7, 9), (0, 5), (300, 40), (1, 1), (64, 2100), (2, 0)]
    params, grads, ms, vs, idxs = [], [], [], [], []
    for i, shape in enumerate(shapes):
        p, g, m, v, idx = make_case("columns", shape, torch.bfloat16, 0.5, seed=i)
        params += p; grads += g; ms += m; vs += v; idxs += idx
    fast, ref = step_both(backend, (params, grads, ms, vs, idxs), "columns", steps=5)
    assert_same_update(fast, ref)


@pytest.mark.parametrize("backend", cpu_backends())
def test_state_full_coordinates_match_adamw_and_the_rest_signsgd(backend):
    """The op's contract spelled out on one tensor with the other ops as oracles."""
    case = make_case("rows", (16, 24), torch.float32, 0.25, seed=10)
    params, grads, m, v, idx = case
    out = [clone(params), clone(m), clone(v)]
    ops.frugal_step_(out[0], grads, out[1], out[2], idx, kind="rows", step=3, backend=backend,
                     **HYPER)
    rows = idx[0]
    full_p = [params[0][rows].clone()]
    ops.adamw_(full_p, [grads[0][rows]], clone(m), clone(v), step=3, backend="torch", **HYPER)
    free_p = [params[0].clone()]
    ops.sign_sgd_(free_p, grads, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                  backend="torch")
    free_rows = torch.ones(16, dtype=torch.bool)
    free_rows[rows] = False
    assert_params_close([out[0][0][rows]], full_p)
    assert torch.equal(out[0][0][free_rows], free_p[0][free_rows])


def _bad_inputs():
    def fresh(kind="rows", shape=(12, 5), density=0.5):
        return make_case(kind, shape, torch.float32, density, seed=11)

    p, g, m, v, idx = fresh()
    yield "kind", (p, g, m, v, idx), {"kind": "diagonal"}, ValueError, "kind must be one of"
    p, g, m, v, idx = fresh()
    yield "rule", (p, g, m, v, idx), {"state_free": "adam"}, ValueError, "state_free must be"
    p, g, m, v, idx = fresh()
    yield "index dtype", (p, g, m, v, [idx[0].float()]), {}, TypeError, "indices[0] has dtype"
    p, g, m, v, idx = fresh()
    yield "index range", (p, g, m, v, [idx[0] + 12]), {}, ValueError, "must be in [0, 12)"
    p, g, m, v, idx = fresh()
    yield "negative index", (p, g, m, v, [idx[0] - 100]), {}, ValueError, "must be in [0, 12)"
    p, g, m, v, idx = fresh()
    yield "unsorted", (p, g, m, v, [idx[0].flip(0)]), {}, ValueError, "sorted and unique"
    p, g, m, v, idx = fresh()
    dup = idx[0].clone()
    dup[1] = dup[0]
    yield "duplicate", (p, g, m, v, [dup]), {}, ValueError, "sorted and unique"
    p, g, m, v, idx = fresh()
    yield "state shape", (p, g, [m[0][:-1]], v, idx), {}, ValueError, "exp_avgs[0] has shape"
    p, g, m, v, idx = fresh("columns")
    yield "columns state", (p, g, m, [v[0].t().contiguous()], idx), {"kind": "columns"}, \
        ValueError, "exp_avg_sqs[0] has shape"
    p, g, m, v, idx = fresh()
    yield "too many", (p, g, m, v, [torch.arange(13)]), {}, ValueError, "13 entries"
    p, g, m, v, idx = fresh()
    yield "lists", (p, g, m, v, idx + idx), {}, ValueError, "2 indices"


@pytest.mark.parametrize("case", list(_bad_inputs()), ids=lambda c: c[0])
def test_bad_input_raises_and_leaves_tensors_untouched(case):
    _, args, overrides, error, message = case
    before = [clone(lst) for lst in args]
    kwargs = {**HYPER, "kind": "rows", "step": 1, **overrides}
    with pytest.raises(error, match=re.escape(message)):
        ops.frugal_step_(*args, **kwargs)
    for lst, saved in zip(args, before):
        for t, s in zip(lst, saved):
            assert torch.equal(t, s)


@pytest.mark.parametrize("kind", ["rows", "columns", "flat"])
def test_opcheck(kind):
    params, grads, m, v, idx = make_case(kind, (9, 13), torch.float32, 0.4, seed=12)
    torch.library.opcheck(torch.ops.frugal.frugal_step_.default,
                          (params, grads, m, v, idx, kind, torch.tensor(1e-3), 0.9, 0.999, 1e-8,
                           0.01, torch.tensor(2.0), "sign", 1.0, "auto"))


@pytest.mark.skipif(extension() is None, reason="compiled extension not built")
@pytest.mark.parametrize("kind,shape", CASES, ids=lambda x: str(x))
def test_every_cpu_isa_level_gives_identical_bits(kind, shape):
    """The AVX-512 level has its own masked path for gathered blocks; all levels
    must agree to the bit."""
    ext = extension()
    runs = {}
    try:
        for level in ext.build_info()["cpu_isa_levels"]:
            if not ext.cpu_select_isa(level):
                continue  # built, but this CPU lacks it
            for dtype in DTYPES:
                for state_free in ("sign", "sgd"):
                    params, grads, m, v, idx = make_case(kind, shape, dtype, 0.3, seed=13)
                    for step in (1, 2):
                        ops.frugal_step_(params, grads, m, v, idx, kind=kind, step=step,
                                         state_free=state_free, backend="cpu", **HYPER)
                    runs.setdefault((dtype, state_free), []).append((level, params + m + v))
    finally:
        ext.cpu_select_isa("auto")
    for key, results in runs.items():
        (base_level, base), *others = results
        for level, tensors in others:
            for x, y in zip(base, tensors):
                assert torch.equal(x, y), f"{level} differs from {base_level} for {key}"
