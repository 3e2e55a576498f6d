"""Property-based tests of every op of the op table against its reference.

Where tests/ops/test_ops.py runs hand-picked samples, hypothesis draws the
call: tensor sizes among 1, primes and 2^k +- 1 around the kernels' block and
chunk sizes, one to three tensors, the dtype, the hyper-parameters over their
valid ranges, the subsets (any density, either index dtype) and the backend
(the compiled CPU kernels, Triton under the interpreter on smaller sizes, and
the CUDA kernels' block bodies on the emulated grid where the binding has
them). Each op's comparison is the one the op table states.

A budget keeps this inside CI time: a few dozen examples per op, a handful
for the interpreter. A new op joins by adding a strategy to ``CALLS``
(test_every_op_has_a_strategy fails until it does).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frugal_kernels._extension import extension
from frugal_kernels._layout import (STATE_FREE_RULES, SUBSET_KINDS, lowrank_dim, lowrank_side,
                                    subset_dim)
from frugal_kernels.ops import CAPABILITIES, _dispatch
from frugal_kernels.ops._common import kernel_batch, subset_batch

from frugal_kernels._quant import QUANT_BITS

from ..op_db import (OPS, SampleInput, dqt_case, frugal_case, frugal_int8_case,
                     int8_moments, lowrank_adamw_case, lowrank_case)
from .helpers import DTYPES, make_batch

# 1, primes, and 2^k +- 1 around the CPU kernels' block (2048) and chunk (2^15).
SIZES = (1, 2, 3, 5, 7, 13, 31, 127, 255, 257, 1021, 2047, 2049, 4095, 4097, 32767, 32769)
MAX_NUMEL = {"cpu": 70_000, "cuda_emulated": 70_000, "triton": 4_200}
EXAMPLES = {"cpu": 40, "cuda_emulated": 20, "triton": 8}
PROPERTY_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.data_too_large])


def _usable(backend: str, op: str) -> bool:
    if backend == "cuda_emulated":
        # op is the op's name, "adamw_"; the binding's entry is adamw_cuda_emulated.
        return extension() is not None and hasattr(extension(), f"{op}cuda_emulated")
    return backend in CAPABILITIES[f"frugal::{op}"] and \
        _dispatch.unavailable_reason(backend, "cpu", f"frugal::{op}") is None


def numels(backend, count):
    """``count`` tensor sizes whose sum stays within the backend's budget."""
    limit = MAX_NUMEL[backend]
    return st.lists(st.sampled_from([s for s in SIZES if s <= limit // count]),
                    min_size=count, max_size=count)


def lr():
    return st.floats(1e-5, 1e-1)


@st.composite
def adamw_call(draw, backend):
    sizes = draw(numels(backend, draw(st.integers(1, 3))))
    dtype = draw(st.sampled_from(DTYPES))
    hyper = dict(lr=draw(lr()), beta1=draw(st.floats(0.0, 0.99)),
                 beta2=draw(st.floats(0.9, 0.9999)), eps=draw(st.floats(1e-10, 1e-6)),
                 weight_decay=draw(st.floats(0.0, 0.2)), maximize=draw(st.booleans()))
    return make_batch(sizes, dtype, seed=draw(st.integers(0, 99))), hyper, dtype


@st.composite
def adamw_int8_call(draw, backend):
    # Rows of every length around the 256-element quantization block, 1- to 3-D.
    count = draw(st.integers(1, 3))
    shapes = []
    for _ in range(count):
        row = draw(st.sampled_from([s for s in SIZES + (256, 512) if s <= 1100]))
        rows = draw(st.sampled_from([s for s in SIZES
                                     if s * row <= MAX_NUMEL[backend] // count]))
        shapes.append(draw(st.sampled_from([(row,), (rows, row), (1, rows, row)])))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 99))
    params, grads, _, _ = make_batch(shapes, dtype, seed=seed)
    hyper = dict(lr=draw(lr()), beta1=draw(st.floats(0.0, 0.99)),
                 beta2=draw(st.floats(0.9, 0.9999)), eps=draw(st.floats(1e-10, 1e-6)),
                 weight_decay=draw(st.floats(0.0, 0.2)), maximize=draw(st.booleans()))
    return (params, grads, *int8_moments(params, seed)), hyper, dtype


@st.composite
def sign_sgd_call(draw, backend):
    sizes = draw(numels(backend, draw(st.integers(1, 3))))
    dtype = draw(st.sampled_from(DTYPES))
    params, grads, _, _ = make_batch(sizes, dtype, seed=draw(st.integers(0, 99)))
    hyper = dict(lr=draw(lr()), weight_decay=draw(st.floats(0.0, 0.2)),
                 scale=draw(st.floats(0.1, 2.0)))
    return (params, grads), hyper, dtype


@st.composite
def sgd_call(draw, backend):
    sizes = draw(numels(backend, draw(st.integers(1, 3))))
    dtype = draw(st.sampled_from(DTYPES))
    params, grads, buffers, _ = make_batch(sizes, dtype, seed=draw(st.integers(0, 99)))
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9, 0.99]))
    nesterov = momentum > 0 and draw(st.booleans())
    dampening = 0.0 if nesterov else draw(st.sampled_from([0.0, 0.1, 0.5]))
    hyper = dict(lr=draw(lr()), momentum=momentum, dampening=dampening,
                 weight_decay=draw(st.floats(0.0, 0.2)), nesterov=nesterov,
                 maximize=draw(st.booleans()), first_step=draw(st.booleans()))
    # Without momentum the op takes no buffers (torch.optim.SGD keeps none).
    return (params, grads, buffers if momentum else []), hyper, dtype


@st.composite
def frugal_step_call(draw, backend):
    kind = draw(st.sampled_from(SUBSET_KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    lists = [[], [], [], [], []]
    for i in range(draw(st.integers(1, 3))):
        rows = draw(st.sampled_from([s for s in SIZES if s <= 300]))
        cols = draw(st.sampled_from([s for s in SIZES
                                     if s * rows <= MAX_NUMEL[backend] // 3]))
        shape = (rows, cols) if draw(st.booleans()) else (rows * cols,)
        if kind != "flat" and len(shape) == 1:
            shape = (rows, cols)
        density = draw(st.sampled_from([0.0, 0.01, 0.25, 0.5, 0.9, 1.0]))
        case = frugal_case(kind, shape, dtype, density, seed=draw(st.integers(0, 99)) + i,
                           index_dtype=index_dtype)
        for lst, part in zip(lists, case):
            lst += part
    hyper = dict(kind=kind, lr=draw(lr()), beta1=draw(st.floats(0.0, 0.99)),
                 beta2=draw(st.floats(0.9, 0.9999)), eps=draw(st.floats(1e-10, 1e-6)),
                 weight_decay=draw(st.floats(0.0, 0.2)),
                 state_free=draw(st.sampled_from(STATE_FREE_RULES)),
                 state_free_scale=draw(st.floats(0.1, 2.0)))
    return tuple(lists), hyper, dtype


@st.composite
def frugal_step_int8_call(draw, backend):
    # Rows and columns subsets of tensors whose compact state's rows fall around the
    # 256-element quantization block; 1-D tensors too (gathered on the CPU).
    kind = draw(st.sampled_from(("rows", "columns")))
    dtype = draw(st.sampled_from(DTYPES))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    lists = [[] for _ in range(7)]
    for i in range(draw(st.integers(1, 3))):
        rows = draw(st.sampled_from([s for s in SIZES if s <= 300]))
        cols = draw(st.sampled_from([s for s in SIZES + (256, 512)
                                     if s * rows <= MAX_NUMEL[backend] // 3]))
        shape = draw(st.sampled_from([(rows, cols), (rows * cols,), (1, rows, cols)]))
        density = draw(st.sampled_from([0.0, 0.01, 0.25, 0.5, 0.9, 1.0]))
        case = frugal_int8_case(kind, shape, dtype, density,
                                seed=draw(st.integers(0, 99)) + i, index_dtype=index_dtype)
        for lst, part in zip(lists, case):
            lst += part
    hyper = dict(kind=kind, lr=draw(lr()), beta1=draw(st.floats(0.0, 0.99)),
                 beta2=draw(st.floats(0.9, 0.9999)), eps=draw(st.floats(1e-10, 1e-6)),
                 weight_decay=draw(st.floats(0.0, 0.2)),
                 state_free=draw(st.sampled_from(STATE_FREE_RULES)),
                 state_free_scale=draw(st.floats(0.1, 2.0)))
    return tuple(lists), hyper, dtype


@st.composite
def lowrank_step_call(draw, backend):
    dtype = draw(st.sampled_from(DTYPES))
    lists = [[], [], [], [], [], []]
    for i in range(draw(st.integers(1, 3))):
        m = draw(st.sampled_from([s for s in SIZES if 2 <= s <= 257]))
        n = draw(st.sampled_from([s for s in SIZES if 2 <= s <= 257]))
        shape = (m, n)
        side = lowrank_side(shape)
        # Below the full rank: at full rank the residual g - P P^T g is rounding
        # noise, and the sign of noise differs between any two correct GEMMs.
        rank = draw(st.integers(1, min(lowrank_dim(shape) - 1, 16)))
        case = lowrank_case(shape, rank, side, dtype, seed=draw(st.integers(0, 99)) + i)
        for lst, part in zip(lists, (*case, side)):
            lst.append(part)
    hyper = dict(lr=draw(lr()), weight_decay=draw(st.floats(0.0, 0.2)),
                 state_free=draw(st.sampled_from(STATE_FREE_RULES)),
                 state_free_scale=draw(st.floats(0.1, 2.0)))
    return tuple(lists), hyper, dtype


@st.composite
def lowrank_adamw_step_call(draw, backend):
    dtype = draw(st.sampled_from(DTYPES))
    lists = [[], [], [], [], [], []]
    for i in range(draw(st.integers(1, 3))):
        shape = (draw(st.sampled_from([s for s in SIZES if 2 <= s <= 257])),
                 draw(st.sampled_from([s for s in SIZES if 2 <= s <= 257])))
        side = lowrank_side(shape)
        # Below the full rank, as for lowrank_step_.
        rank = draw(st.integers(1, min(lowrank_dim(shape) - 1, 16)))
        case = lowrank_adamw_case(shape, rank, side, dtype, seed=draw(st.integers(0, 99)) + i)
        for lst, part in zip(lists, (*case, side)):
            lst.append(part)
    hyper = dict(lr=draw(lr()), beta1=draw(st.floats(0.0, 0.99)),
                 beta2=draw(st.floats(0.9, 0.9999)), eps=draw(st.floats(1e-10, 1e-6)),
                 weight_decay=draw(st.floats(0.0, 0.2)),
                 state_free=draw(st.sampled_from(STATE_FREE_RULES)),
                 state_free_scale=draw(st.floats(0.1, 2.0)))
    return tuple(lists), hyper, dtype


@st.composite
def dqt_update_call(draw, backend):
    kind = draw(st.sampled_from(SUBSET_KINDS))
    bits = draw(st.sampled_from(QUANT_BITS))
    dtype = draw(st.sampled_from(DTYPES))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    lists = [[], [], [], [], [], []]
    for i in range(draw(st.integers(1, 3))):
        rows = draw(st.sampled_from([s for s in SIZES if s <= 300]))
        cols = draw(st.sampled_from([s for s in SIZES if s * rows <= MAX_NUMEL[backend] // 3]))
        density = draw(st.sampled_from([0.0, 0.01, 0.25, 0.5, 0.9, 1.0]))
        case = dqt_case((rows, cols), bits, kind, density, dtype,
                        seed=draw(st.integers(0, 99)) + i, per_row=draw(st.booleans()),
                        index_dtype=index_dtype)
        for lst, part in zip(lists, case):
            lst += part
    hyper = dict(kind=kind, bits=bits, lr=draw(lr()), beta1=draw(st.floats(0.0, 0.99)),
                 beta2=draw(st.floats(0.9, 0.9999)), eps=draw(st.floats(1e-10, 1e-6)),
                 weight_decay=draw(st.floats(0.0, 0.2)),
                 state_free=draw(st.sampled_from(STATE_FREE_RULES)),
                 state_free_scale=draw(st.floats(0.1, 2.0)),
                 seeds=draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(lists[0]),
                                     max_size=len(lists[0]))),
                 rng_step=draw(st.integers(0, 2**32 - 1)))
    return tuple(lists), hyper, dtype


CALLS = {"adamw_": adamw_call, "adamw_int8_": adamw_int8_call, "sign_sgd_": sign_sgd_call, "sgd_": sgd_call,
         "frugal_step_": frugal_step_call, "frugal_step_int8_": frugal_step_int8_call,
         "lowrank_step_": lowrank_step_call,
         "lowrank_adamw_step_": lowrank_adamw_step_call, "dqt_update_": dqt_update_call}


def test_every_op_has_a_strategy():
    assert sorted(CALLS) == sorted(op.name for op in OPS)


# ---------------------------------------------------------------- the emulated CUDA grid

def _emulated(op_name):
    """The functional face of ``op_name`` on the emulated CUDA grid: the ops'
    own kernel records, the emulated kernels of the binding."""
    from frugal_kernels.ops import (adamw, adamw_int8, dqt_update, frugal_step, frugal_step_int8,
                                    sign_sgd)

    ext = extension()
    no_pointers = ext.DeviceScalars(lr=0, step=0)
    no_scaler = dict(grad_scale=None, found_inf=None)

    def run(*lists, step=None, **hyper):
        # Weights without elements are left out, as the ops do (for dqt_update_
        # the packed codes of an empty weight are empty too).
        keep = [i for i, p in enumerate(lists[0]) if p.numel() > 0]
        lists = [[lst[i] for i in keep] for lst in lists]
        if not keep:
            return
        if op_name == "adamw_":
            p, g, m, v = lists
            h = adamw.AdamWHyper(step=step, **hyper, **no_scaler)
            ext.adamw_cuda_emulated(kernel_batch(ext, p, g, m, v), h.kernel(ext), no_pointers)
        elif op_name == "adamw_int8_":
            t = adamw_int8.Tensors(*lists)
            h = adamw.AdamWHyper(step=step, **hyper, **no_scaler)
            ext.adamw_int8_cuda_emulated(kernel_batch(ext, t.params, t.grads),
                                         adamw_int8.moments8_batch(ext, t), h.kernel(ext),
                                         no_pointers)
        elif op_name == "sign_sgd_":
            p, g = lists
            h = sign_sgd.SignSgdHyper(**hyper, **no_scaler)
            ext.sign_sgd_cuda_emulated(kernel_batch(ext, p, g), h.kernel(ext), no_pointers)
        elif op_name == "frugal_step_int8_":
            t = frugal_step_int8.Tensors(*lists, hyper.pop("kind"))
            h = frugal_step.FrugalHyper(step=step, **hyper, **no_scaler)
            ext.frugal_step_int8_cuda_emulated(kernel_batch(ext, t.params, t.grads),
                                               subset_batch(ext, t.params, t.indices, t.kind),
                                               adamw_int8.moments8_batch(ext, t), h.kernel(ext),
                                               no_pointers)
        elif op_name == "dqt_update_":
            kind = hyper.pop("kind")
            seeds = hyper.pop("seeds")
            seeds = [seeds[i] for i in keep]
            h = dqt_update.DqtHyper(step=step, **hyper, **no_scaler)
            t = dqt_update.Tensors(*lists, kind, seeds)
            ext.dqt_update_cuda_emulated(*dqt_update._kernel_batches(ext, t), h.kernel(ext),
                                         no_pointers)
        else:
            p, g, m, v, idx = lists
            kind = hyper.pop("kind")
            h = frugal_step.FrugalHyper(step=step, **hyper, **no_scaler)
            ext.frugal_step_cuda_emulated(kernel_batch(ext, p, g, m, v),
                                          subset_batch(ext, p, idx, kind),
                                          h.kernel(ext), no_pointers)
    return run


# ---------------------------------------------------------------- the test

def _rows():
    for op in OPS:
        for backend in ("cpu", "cuda_emulated", "triton"):
            usable = _usable(backend, op.name)
            marks = [] if usable else [pytest.mark.skip(reason=f"{backend} cannot run "
                                                               f"{op.name} here")]
            if backend == "cuda_emulated" and not usable and extension() is not None:
                continue  # no emulated kernel for this op in the binding: nothing to run
            yield pytest.param(op, backend, marks=marks, id=f"{op.name}-{backend}")


@pytest.mark.parametrize("op,backend", list(_rows()))
def test_matches_reference_on_drawn_calls(op, backend):
    @settings(max_examples=EXAMPLES[backend], **PROPERTY_SETTINGS)
    @given(call=CALLS[op.name](backend), steps=st.integers(1, 3),
           first_step=st.integers(1, 5000))
    def check(call, steps, first_step):
        args, hyper, dtype = call
        sample = SampleInput("drawn", None, steps=steps, first_step=first_step)
        if backend == "cuda_emulated":
            fast = op.run(_emulated(op.name), (args, hyper), sample)
        else:
            fast = op.run(op.op, (args, hyper), sample, backend=backend)
        ref = op.run(op.ref, (args, hyper), sample)
        for name, a, e in zip(op.outputs, fast, ref):
            op.compare(a, e, dtype, name)
    check()

