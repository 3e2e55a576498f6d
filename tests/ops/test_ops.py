"""The tests every fused op gets, driven by the op table (tests/op_db.py).

Each entry runs on every backend the capability table lists for CPU tensors
(a backend that cannot run here is shown as skipped with its reason): against
the reference over its samples (dtypes, odd sizes, empty tensors, several
tensors per call), with 0-dim tensor scalars, with empty lists, with each of
its error inputs (the error is raised and no tensor changes), through
torch.library.opcheck and, for the compiled CPU kernels, at every ISA level.
"""

import re
from pathlib import Path

import pytest
import torch

from frugal_kernels._extension import extension
from frugal_kernels.ops import BACKENDS, CAPABILITIES
from frugal_kernels.ops._dispatch import unavailable_reason

from ..op_db import OPS, OUT_OF_PLACE_OPS
from .helpers import cpu_backends


def _dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def _sample_rows():
    for op in OPS:
        for sample in op.samples:
            for backend in cpu_backends(op.qualname):
                for dtype in sample.dtypes:
                    yield pytest.param(op, sample, backend.values[0], dtype, marks=backend.marks,
                                       id=f"{op.name}-{sample.name}-{backend.id}-"
                                          f"{_dtype_id(dtype)}")


def _outputs_match(op, sample, fast, ref, dtype):
    compare = sample.compare or op.compare
    for name, a, e in zip(op.outputs, fast, ref):
        assert [t.shape for t in a] == [t.shape for t in e], f"{name}: shapes changed"
        assert [t.dtype for t in a] == [t.dtype for t in e], f"{name}: dtypes changed"
        compare(a, e, dtype, name)


@pytest.mark.parametrize("op,sample,backend,dtype", list(_sample_rows()))
def test_matches_reference(op, sample, backend, dtype):
    call = sample.make(dtype, backend)
    fast = op.run(op.op, call, sample, backend=backend)
    ref = op.run(op.ref, call, sample)
    _outputs_match(op, sample, fast, ref, dtype)


def _tensor_scalar_rows():
    for op in OPS:
        for backend in cpu_backends(op.qualname):
            yield pytest.param(op, backend.values[0], id=f"{op.name}-{backend.id}",
                               marks=backend.marks)


@pytest.mark.parametrize("op,backend", list(_tensor_scalar_rows()))
def test_tensor_scalars_give_the_same_bits_as_numbers(op, backend):
    """lr as a 0-dim tensor (and step as a float tensor) is the same update."""
    sample = op.sample(op.tensor_scalar_sample)
    call = sample.make(torch.float32, backend)
    numbers = op.run(op.op, call, sample, backend=backend)
    tensors = op.run(op.op, call, sample, backend=backend, tensor_scalars=True)
    for name, a, b in zip(op.outputs, numbers, tensors):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"{name}[{i}]"


@pytest.mark.parametrize("op,backend", list(_tensor_scalar_rows()))
def test_empty_lists_are_a_no_op(op, backend):
    assert op.op(*([[]] * op.num_lists), **op.empty_kwargs, backend=backend) is None
    assert op.ref(*([[]] * op.num_lists), **op.empty_kwargs) is None


def _error_rows():
    for op in OPS:
        for err in op.error_inputs:
            yield pytest.param(op, err, id=f"{op.name}-{err.name}")


def _tensors(args):
    return [t for lst in args for t in lst if isinstance(t, torch.Tensor)]


def _assert_raises_and_leaves_tensors_untouched(op, args, kwargs, error, match):
    tensors = _tensors(args)
    before = [t.clone() for t in tensors]
    with pytest.raises(error, match=re.escape(match)):
        op.op(*args, **kwargs)
    for i, (t, saved) in enumerate(zip(tensors, before)):
        if t.device.type != "meta":
            assert torch.equal(t, saved), f"tensor {i} of the call changed"


@pytest.mark.parametrize("op,err", list(_error_rows()))
def test_bad_input_raises_and_leaves_tensors_untouched(op, err):
    args, kwargs = err.make()
    _assert_raises_and_leaves_tensors_untouched(op, args, kwargs, err.error, err.match)


def _unusable_backend_rows():
    for op in OPS:
        for backend in ("nope", *BACKENDS):
            reason = unavailable_reason(backend, "cpu", op.qualname)
            if reason is not None:
                yield pytest.param(op, backend, reason, id=f"{op.name}-{backend}")


@pytest.mark.parametrize("op,backend,reason", list(_unusable_backend_rows()))
def test_a_backend_that_cannot_run_raises_and_leaves_tensors_untouched(op, backend, reason):
    sample = op.samples[0]
    args, kwargs = sample.make(torch.float32, "torch")
    kwargs = {**kwargs, "backend": backend, **({"step": 1} if op.counts_steps else {})}
    _assert_raises_and_leaves_tensors_untouched(op, args, kwargs, ValueError, reason)


def _opcheck_rows():
    for op in OPS:
        for name, make in op.opcheck_inputs:
            yield pytest.param(op, make, id=f"{op.name}-{name}")


@pytest.mark.parametrize("op,make", list(_opcheck_rows()))
def test_opcheck(op, make):
    torch.library.opcheck(op.registered, make())


def _isa_rows():
    for op in OPS:
        for sample in op.samples:
            for dtype in sample.dtypes:
                for backend in cpu_backends(op.qualname):
                    if backend.values[0] == "cpu":
                        yield pytest.param(op, sample, dtype, marks=backend.marks,
                                           id=f"{op.name}-{sample.name}-{_dtype_id(dtype)}")


@pytest.mark.skipif(extension() is None, reason="compiled extension not built")
@pytest.mark.parametrize("op,sample,dtype", list(_isa_rows()))
def test_every_cpu_isa_level_gives_identical_bits(op, sample, dtype):
    """Each ISA level (scalar, AVX2, AVX-512 with its own masked paths for
    gathered blocks, ...) must agree to the bit."""
    ext = extension()
    call = sample.make(dtype, "cpu")
    runs = {}
    try:
        for level in ext.build_info()["cpu_isa_levels"]:
            if not ext.cpu_select_isa(level):
                continue  # built, but this CPU lacks it
            for v, variant in enumerate(op.isa_variants):
                out = op.run(op.op, call, sample, backend="cpu", **variant)
                runs.setdefault(v, []).append((level, [t for lst in out for t in lst]))
    finally:
        ext.cpu_select_isa("auto")
    for v, results in runs.items():
        (base_level, base), *others = results
        for level, tensors in others:
            for x, y in zip(base, tensors):
                assert torch.equal(x, y), \
                    f"{level} differs from {base_level} under {op.isa_variants[v]}"


def test_every_op_of_the_capability_table_is_tested():
    """A new op joins the table, or the out-of-place list with a test file of its own."""
    assert not {op.name for op in OPS} & set(OUT_OF_PLACE_OPS)
    tested = {op.name for op in OPS} | set(OUT_OF_PLACE_OPS)
    assert tested == {name.split("::")[1] for name in CAPABILITIES}
    root = Path(__file__).resolve().parents[2]
    for name, path in OUT_OF_PLACE_OPS.items():
        assert (root / path).is_file(), f"{name}: {path} is missing"
