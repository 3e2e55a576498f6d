"""The op table: one :class:`OpInfo` per fused op, in the style of PyTorch's OpInfo.

An entry says what the op is (its functional face and its reference), how to
call it (sample inputs over dtypes and sizes, with how to compare the results),
how not to call it (error inputs with the exception and a fragment of its
message) and how to check its registration (opcheck inputs). The generic tests
of tests/ops/test_ops.py run every entry on every backend the capability table
(``frugal_kernels.ops.CAPABILITIES``) lists for CPU tensors. A new op, such as
DQT's ``dqt_update_`` or BAdam's, joins by adding an entry to :data:`OPS`; what
no other op shares stays in tests/ops/test_<op>.py.

Sample tensors are built lazily (``make(dtype, backend)``), so collecting the
tests costs nothing and the Triton interpreter, which is slow, gets smaller
sizes where a sample says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from frugal_kernels import _quant, ops, reference
from frugal_kernels._layout import (
    LEFT,
    RIGHT,
    STATE_FREE_RULES,
    SUBSET_KINDS,
    subset_dim,
)
from frugal_kernels._layout import subset_state_shape as state_shape

from .ops.helpers import (
    DTYPES,
    assert_bits_close,
    assert_params_close,
    make_batch,
    ulp_diff,
)

# (args, kwargs) of one call: lists of tensors (or of ints: lowrank's sides) and options.
Call = Tuple[tuple, dict]
Compare = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], torch.dtype, str], None]

FP32 = (torch.float32,)


def grad_scaler_args():
    """The registered ops' (grad_scale, found_inf) arguments as a GradScaler passes them."""
    return torch.tensor(4.0), torch.tensor(0.0)


@dataclass(frozen=True)
class SampleInput:
    """One way to call an op: ``make(dtype, backend)`` builds the call; the op
    runs ``steps`` times on it (``step`` counting from ``first_step`` for ops
    that take a step count)."""

    name: str
    make: Callable[[torch.dtype, str], Call]
    steps: int = 1
    first_step: int = 1
    dtypes: Tuple[torch.dtype, ...] = DTYPES
    compare: Optional[Compare] = None  # None: the op's own comparison


@dataclass(frozen=True)
class ErrorInput:
    """A call that must raise ``error`` with ``match`` in its message and leave
    every tensor as it was."""

    name: str
    make: Callable[[], Call]
    error: type
    match: str


@dataclass(frozen=True)
class OpInfo:
    name: str                       # at every layer: ops.<name>, torch.ops.frugal.<name>
    op: Callable                    # the functional face, frugal_kernels.ops.<name>
    ref: Callable                   # the ground truth, frugal_kernels.reference.<name>
    outputs: Tuple[str, ...]        # the positional lists the op updates, by argument name ...
    output_positions: Tuple[int, ...]  # ... and position
    num_lists: int                  # how many positional lists a call takes
    samples: Tuple[SampleInput, ...]
    error_inputs: Tuple[ErrorInput, ...]
    opcheck_inputs: Tuple[Tuple[str, Callable[[], tuple]], ...]  # args of the registered op
    empty_kwargs: dict              # the options of a call with empty lists
    compare: Compare                # how a backend's outputs must match the reference's
    counts_steps: bool = False      # takes ``step`` (the count after this update)
    tensor_scalar_sample: str = ""  # the sample that checks 0-dim tensor lr (and step)
    # Option sets every compiled-CPU sample also runs under, across ISA levels.
    isa_variants: Tuple[dict, ...] = ({},)
    grad_position: int = 1          # the positional list of the gradients

    @property
    def qualname(self) -> str:
        return f"frugal::{self.name}"

    @property
    def registered(self):
        return getattr(torch.ops.frugal, self.name).default

    def sample(self, name: str) -> SampleInput:
        return next(s for s in self.samples if s.name == name)

    def run(self, fn: Callable, call: Call, sample: SampleInput, *, tensor_scalars=False,
            **extra) -> list:
        """Step copies of the lists ``fn`` updates ``sample.steps`` times; returns them.
        Inputs the op only reads are shared by every run."""
        args, kwargs = call
        args = list(args)
        for i in self.output_positions:
            args[i] = [t.clone() for t in args[i]]
        for k in range(sample.steps):
            kw = {**kwargs, **extra}
            if self.counts_steps:
                kw["step"] = sample.first_step + k
            if tensor_scalars:
                kw["lr"] = torch.tensor(kw["lr"])
                if self.counts_steps:
                    kw["step"] = torch.tensor(float(kw["step"]))
            fn(*args, **kw)
        return [args[i] for i in self.output_positions]


def compare_close(actual, expected, dtype, what):
    """fp32 within 1e-6 relative, 16-bit within one ulp."""
    assert_params_close(actual, expected, what=what)


def compare_bits(actual, expected, dtype, what):
    """The same operations in the same order: exact in fp32; the interpreter's
    16-bit stores may round one ulp apart (DESIGN.md section 6)."""
    assert_bits_close(actual, expected, fp32_ulps=0, ulps=1, what=what)


# ---------------------------------------------------------------- adamw_

ADAMW_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
# 1, a prime, 2^12 - 1 and 2^12 + 1 around the kernels' block sizes, 2^20 + 3 for
# the multi-block and threaded paths.
SIZES = [1, 7, 4095, 4097, 2**20 + 3]
TRITON_MAX_SIZE = 2**16 + 3  # the interpreter is slow; larger sizes add no new path there


def _size_for(backend: str, size: int) -> int:
    return TRITON_MAX_SIZE if backend == "triton" and size > 2**16 else size


def _adamw_sized(size):
    def make(dtype, backend):
        n = _size_for(backend, size)
        return make_batch([n], dtype, seed=n), ADAMW_HYPER
    return make


def _adamw_mixed(dtype, backend):
    batch = make_batch([5, 0, 1000, 1, (3, 0), (33, 65), 4096], dtype, seed=1)
    return batch, {**ADAMW_HYPER, "maximize": True}


def _adamw_two(dtype, backend):
    return make_batch([300, 5], dtype, seed=2), {**ADAMW_HYPER, "lr": 2e-3}


def _adamw_errors():
    def fresh():
        return make_batch([10, 6], torch.float32, seed=4)

    def case(name, change, error, match, **overrides):
        def make():
            return change(*fresh()), {**ADAMW_HYPER, "step": 1, **overrides}
        return ErrorInput(name, make, error, match)

    def non_contiguous(p, g, m, v):
        big = torch.randn(6, 4)
        return [p[0], big.t()], [g[0], torch.randn(4, 6)], m, [v[0], torch.zeros(4, 6)]

    same = (lambda p, g, m, v: (p, g, m, v))
    return (
        case("length", lambda p, g, m, v: (p, g[:1], m, v), ValueError, "1 grads"),
        case("grad dtype", lambda p, g, m, v: (p, [g[0].double(), g[1]], m, v), TypeError,
             "grads[0] has dtype"),
        case("param dtype", lambda p, g, m, v: ([p[0], p[1].half()], [g[0], g[1].half()], m, v),
             TypeError, "params[1] has dtype"),
        case("int params", lambda p, g, m, v: ([x.long() for x in p], [x.long() for x in g], m,
                                               v), TypeError, "supported dtypes"),
        case("state dtype", lambda p, g, m, v: (p, g, [m[0].double(), m[1]], v), TypeError,
             "exp_avgs[0]"),
        case("grad shape", lambda p, g, m, v: (p, [g[0], g[1][:3]], m, v), ValueError,
             "grads[1] has shape"),
        case("state shape", lambda p, g, m, v: (p, g, m, [v[0], v[1][:2]]), ValueError,
             "exp_avg_sqs[1] has shape"),
        case("non-contiguous param", non_contiguous, ValueError, "not contiguous"),
        case("device", lambda p, g, m, v: (p, [g[0], g[1].to("meta")], m, v), ValueError,
             "is on meta"),
        case("step 0", same, ValueError, "step counts updates from 1", step=0),
        case("beta", same, ValueError, "beta1", beta1=1.0),
        case("lr shape", same, ValueError, "lr must be", lr=torch.ones(2)),
    )


def _adamw_opcheck():
    p, g, m, v = make_batch([33, 4], torch.float32, seed=5)
    return (p, g, m, v, torch.tensor(1e-3), 0.9, 0.999, 1e-8, 0.01, torch.tensor(3.0), False,
            *grad_scaler_args(), "auto")


ADAMW = OpInfo(
    name="adamw_", op=ops.adamw_, ref=reference.adamw_,
    outputs=("params", "exp_avgs", "exp_avg_sqs"), output_positions=(0, 2, 3), num_lists=4,
    samples=(
        *(SampleInput(f"size={n}", _adamw_sized(n), steps=3) for n in SIZES),
        SampleInput("mixed sizes and empty tensors, maximize", _adamw_mixed, steps=10),
        SampleInput("two tensors from step 4", _adamw_two, first_step=4),
    ),
    error_inputs=_adamw_errors(),
    opcheck_inputs=(("two tensors", _adamw_opcheck),),
    empty_kwargs={**ADAMW_HYPER, "step": 1},
    compare=compare_close, counts_steps=True, tensor_scalar_sample="two tensors from step 4",
)

# ---------------------------------------------------------------- adamw_int8_

def int8_moments(params, seed):
    """The 8-bit moments (codes and scales of each) of random fp32 moments of ``params``:
    signed first moments and second moments spread over four decades."""
    gen = torch.Generator().manual_seed(seed)
    lists = ([], [], [], [])
    for p in params:
        m = torch.randn(p.shape, generator=gen) * 1e-2
        v = torch.rand(p.shape, generator=gen) ** 8 * 1e-4
        for lst, t in zip(lists, (*reference.quantize_moment(m, False),
                                  *reference.quantize_moment(v, True))):
            lst.append(t)
    return lists


def _int8_batch(shapes, dtype, seed):
    params, grads, _, _ = make_batch(shapes, dtype, seed=seed)
    return (params, grads, *int8_moments(params, seed))


def _adamw_int8(shapes, **options):
    """A sample maker; ``shapes`` may depend on the backend (a callable)."""
    def make(dtype, backend):
        s = shapes(backend) if callable(shapes) else shapes
        return _int8_batch(s, dtype, seed=len(str(s))), {**ADAMW_HYPER, **options}
    return make


def compare_exact(actual, expected, dtype, what):
    """The same fp32 operations in the same order, then the same rounding: every param,
    code and scale equal."""
    for i, (a, e) in enumerate(zip(actual, expected)):
        apart = (a != e).sum().item()
        assert apart == 0, f"{what}[{i}]: {apart} elements differ"


def _adamw_int8_errors():
    def case(name, change, error, match, **overrides):
        def make():
            return change(*_int8_batch([(10, 300), 6], torch.float32, 4)), \
                {**ADAMW_HYPER, "step": 1, **overrides}
        return ErrorInput(name, make, error, match)

    def non_contiguous(p, g, m, ms, v, vs):
        t = torch.zeros(300, 10, dtype=torch.int8).t()
        return p, g, [t, m[1]], ms, v, vs

    same = (lambda *a: a)
    return (
        case("length", lambda p, g, m, ms, v, vs: (p, g, m, ms[:1], v, vs), ValueError,
             "1 exp_avg_scales"),
        case("code dtype", lambda p, g, m, ms, v, vs: (p, g, m, ms, [v[0].to(torch.int8), v[1]],
                                                       vs), TypeError, "exp_avg_sqs[0] has dtype"),
        case("fp32 moments", lambda p, g, m, ms, v, vs: (p, g, [x.float() for x in m], ms, v, vs),
             TypeError, "exp_avgs[0] has dtype"),
        case("scale shape", lambda p, g, m, ms, v, vs: (p, g, m, ms, v, [vs[0][:, :1], vs[1]]),
             ValueError, "exp_avg_sq_scales[0] has shape (10, 1) but must have shape (10, 2)"),
        case("code shape", lambda p, g, m, ms, v, vs: (p, g, [m[0].view(-1), m[1]], ms, v, vs),
             ValueError, "exp_avgs[0] has shape (3000,)"),
        case("non-contiguous codes", non_contiguous, ValueError, "exp_avgs[0] is not contiguous"),
        case("device", lambda p, g, m, ms, v, vs: (p, g, m, [ms[0].to("meta"), ms[1]], v, vs),
             ValueError, "exp_avg_scales[0] is on meta"),
        case("grad shape", lambda p, g, m, ms, v, vs: (p, [g[0], g[1][:3]], m, ms, v, vs),
             ValueError, "grads[1] has shape"),
        case("step 0", same, ValueError, "step counts updates from 1", step=0),
        case("beta", same, ValueError, "beta2", beta2=1.5),
    )


def _adamw_int8_opcheck():
    return (*_int8_batch([(33, 300), 4], torch.float32, 5), torch.tensor(1e-3), 0.9, 0.999,
            1e-8, 0.01, torch.tensor(3.0), False, *grad_scaler_args(), "auto")


ADAMW_INT8 = OpInfo(
    name="adamw_int8_", op=ops.adamw_int8_, ref=reference.adamw_int8_,
    outputs=("params", "exp_avgs", "exp_avg_scales", "exp_avg_sqs", "exp_avg_sq_scales"),
    output_positions=(0, 2, 3, 4, 5), num_lists=6,
    samples=(
        # One row of 2^20 + 3 (4097 blocks, the last of 3 elements) for the threaded path;
        # rows shorter than a block, a block and one, a 3-D tensor's rows of 700.
        SampleInput("one long row", _adamw_int8(lambda b: [_size_for(b, 2**20 + 3)]), steps=3),
        SampleInput("rows of 1, 7, 257", _adamw_int8([(1, 1), (40, 7), (9, 257)]), steps=3),
        SampleInput("rows of 1017 (517 on triton)",
                    _adamw_int8(lambda b: [(131, 517) if b == "triton" else (1031, 1017)]),
                    steps=2, dtypes=FP32),
        SampleInput("mixed sizes and empty tensors, maximize",
                    _adamw_int8([5, 0, (3, 0), (0, 4), (), (3, 2, 700), 4096], maximize=True),
                    steps=10),
        SampleInput("two tensors from step 4", _adamw_int8([(300, 5), (5, 300)], lr=2e-3),
                    first_step=4),
    ),
    error_inputs=_adamw_int8_errors(),
    opcheck_inputs=(("two tensors", _adamw_int8_opcheck),),
    empty_kwargs={**ADAMW_HYPER, "step": 1},
    compare=compare_exact, counts_steps=True, tensor_scalar_sample="two tensors from step 4",
    isa_variants=({}, {"maximize": True}),
)

# ---------------------------------------------------------------- sign_sgd_

SIGN_SGD_HYPER = dict(lr=1e-2, weight_decay=0.1, scale=0.5)


def _sign_sgd_sized(size):
    def make(dtype, backend):
        n = _size_for(backend, size)
        params, grads, _, _ = make_batch([n, 3], dtype, seed=n)
        grads[0].view(-1)[::5] = 0  # sign(0) = 0: those coordinates only decay
        return (params, grads), SIGN_SGD_HYPER
    return make


def _sign_sgd_mixed(dtype, backend):
    params, grads, _, _ = make_batch([0, 5, (4, 0), 1000, (7, 9)], dtype, seed=1)
    return (params, grads), dict(lr=3e-3)


def _sign_sgd_errors():
    def case(name, change, error, match):
        def make():
            params, grads, _, _ = make_batch([10, 6], torch.float32)
            return change(params, grads), dict(lr=0.1)
        return ErrorInput(name, make, error, match)

    return (
        case("length", lambda p, g: ([p[0]], g), ValueError, "got 1 params but 2 grads"),
        case("grad dtype", lambda p, g: (p, [g[0].half(), g[1]]), TypeError,
             "grads[0] has dtype"),
        case("non-contiguous param",
             lambda p, g: ([p[0], torch.randn(6, 3).t()], [g[0], torch.randn(3, 6)]),
             ValueError, "params[1] is not contiguous"),
        case("grad shape", lambda p, g: (p, [g[0], g[1][:2]]), ValueError, "grads[1] has shape"),
    )


def _sign_sgd_opcheck():
    params, grads, _, _ = make_batch([33, 4], torch.float32, seed=5)
    return (params, grads, torch.tensor(1e-3), 0.01, 1.0, *grad_scaler_args(), "auto")


SIGN_SGD = OpInfo(
    name="sign_sgd_", op=ops.sign_sgd_, ref=reference.sign_sgd_,
    outputs=("params",), output_positions=(0,), num_lists=2,
    samples=(
        *(SampleInput(f"size={n}", _sign_sgd_sized(n), steps=3) for n in SIZES),
        SampleInput("mixed sizes and empty tensors", _sign_sgd_mixed),
    ),
    error_inputs=_sign_sgd_errors(),
    opcheck_inputs=(("two tensors", _sign_sgd_opcheck),),
    empty_kwargs=dict(lr=0.1),
    compare=compare_bits, tensor_scalar_sample="mixed sizes and empty tensors",
)

# ---------------------------------------------------------------- sgd_

SGD_HYPER = dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.05)


def _sgd_sized(size):
    def make(dtype, backend):
        n = _size_for(backend, size)
        params, grads, buffers, _ = make_batch([n, 3], dtype, seed=n)
        return (params, grads, buffers), SGD_HYPER
    return make


def _sgd_first_step(dtype, backend):
    # The buffers hold garbage: the first step must overwrite, not read, them.
    params, grads, _, _ = make_batch([5, (4, 0), 1000, (7, 9)], dtype, seed=1)
    buffers = [torch.full(p.shape, float("nan")) for p in params]
    return (params, grads, buffers), {**SGD_HYPER, "first_step": True}


def _sgd_nesterov(dtype, backend):
    params, grads, buffers, _ = make_batch([0, 300, (33, 65)], dtype, seed=2)
    return (params, grads, buffers), dict(lr=3e-3, momentum=0.8, weight_decay=0.01,
                                          nesterov=True, maximize=True)


def _sgd_plain(dtype, backend):
    params, grads, _, _ = make_batch([7, 0, 4097], dtype, seed=3)
    return (params, grads, []), dict(lr=0.1, weight_decay=0.2)


def _sgd_errors():
    def case(name, change, error, match, **overrides):
        def make():
            params, grads, buffers, _ = make_batch([10, 6], torch.float32, seed=4)
            return change(params, grads, buffers), {**SGD_HYPER, **overrides}
        return ErrorInput(name, make, error, match)

    same = (lambda p, g, b: (p, g, b))
    return (
        case("buffer count", lambda p, g, b: (p, g, b[:1]), ValueError, "1 momentum_buffers"),
        case("buffer dtype", lambda p, g, b: (p, g, [b[0].half(), b[1]]), TypeError,
             "momentum_buffers[0]"),
        case("buffer shape", lambda p, g, b: (p, g, [b[0], b[1][:2]]), ValueError,
             "momentum_buffers[1] has shape"),
        case("grad dtype", lambda p, g, b: (p, [g[0].double(), g[1]], b), TypeError,
             "grads[0] has dtype"),
        case("buffers without momentum", same, ValueError, "momentum_buffers must be empty",
             momentum=0.0),
        case("nesterov with dampening", same, ValueError, "nesterov needs", nesterov=True),
        case("negative momentum", same, ValueError, "momentum must be >= 0", momentum=-0.5),
        case("lr", same, ValueError, "lr must be finite", lr=float("inf")),
    )


def _sgd_opcheck():
    params, grads, buffers, _ = make_batch([33, 4], torch.float32, seed=5)
    return (params, grads, buffers, torch.tensor(1e-3), 0.9, 0.0, 0.01, True, False, False,
            *grad_scaler_args(), "auto")


SGD = OpInfo(
    name="sgd_", op=ops.sgd_, ref=reference.sgd_,
    outputs=("params", "momentum_buffers"), output_positions=(0, 2), num_lists=3,
    samples=(
        *(SampleInput(f"size={n}", _sgd_sized(n), steps=3) for n in SIZES),
        SampleInput("first step over garbage buffers", _sgd_first_step),
        SampleInput("nesterov, maximize", _sgd_nesterov, steps=5),
        SampleInput("no momentum", _sgd_plain, steps=2),
    ),
    error_inputs=_sgd_errors(),
    opcheck_inputs=(("two tensors, nesterov", _sgd_opcheck),),
    empty_kwargs=dict(lr=0.1),
    compare=compare_bits, tensor_scalar_sample="nesterov, maximize",
    isa_variants=({}, {"maximize": True}),
)

# ---------------------------------------------------------------- frugal_step_

FRUGAL_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)

# (kind, shape): rows of many lengths (the CPU walks long rows in place and
# gathers rows of length 1), columns narrower and wider than a CPU block of
# 2048, flat lists over 1-D and 3-D tensors.
FRUGAL_CASES = [
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
    """Sorted unique ids of a random state-full subset of rows, columns or coordinates."""
    n = subset_dim(torch.empty(shape, device="meta"), kind)
    gen = torch.Generator().manual_seed(seed)
    k = round(density * n)
    return torch.randperm(n, generator=gen)[:k].sort().values.to(dtype)


def frugal_case(kind, shape, dtype, density, seed, index_dtype=torch.int64):
    """(params, grads, exp_avgs, exp_avg_sqs, indices) of one tensor of ``shape``."""
    idx = subset(shape, kind, density, seed, index_dtype)
    st = state_shape(torch.empty(shape, device="meta"), kind, idx.numel())
    params, grads, m, v = make_batch([shape], dtype, seed=seed, state_shapes=[st])
    return params, grads, m, v, [idx]


def _frugal(kind, shape, density, seed, index_dtype=torch.int64, **options):
    """A sample maker; ``shape`` may depend on the backend (a callable)."""
    def make(dtype, backend):
        s = shape(backend) if callable(shape) else shape
        case = frugal_case(kind, s, dtype, density, seed, index_dtype)
        return case, {**FRUGAL_HYPER, "kind": kind, **options}
    return make


def _frugal_many(dtype, backend):
    shapes = [(7, 9), (0, 5), (300, 40), (1, 1), (64, 2100), (2, 0)]
    lists = [[], [], [], [], []]
    for i, shape in enumerate(shapes):
        for lst, part in zip(lists, frugal_case("columns", shape, dtype, 0.5, seed=i)):
            lst += part
    return tuple(lists), {**FRUGAL_HYPER, "kind": "columns"}


def _large_shape(backend):
    return (131, 517) if backend == "triton" else (1031, 1017)  # 2^20 + 3 elements off triton


def _frugal_errors():
    def case(name, change, error, match, shape_kind="rows", **overrides):
        def make():
            args = frugal_case(shape_kind, (12, 5), torch.float32, 0.5, seed=11)
            return change(*args), {**FRUGAL_HYPER, "kind": "rows", "step": 1, **overrides}
        return ErrorInput(name, make, error, match)

    def duplicate(p, g, m, v, idx):
        dup = idx[0].clone()
        dup[1] = dup[0]
        return p, g, m, v, [dup]

    same = (lambda *a: a)
    return (
        case("kind", same, ValueError, "kind must be one of", kind="diagonal"),
        case("rule", same, ValueError, "state_free must be", state_free="adam"),
        case("index dtype", lambda p, g, m, v, idx: (p, g, m, v, [idx[0].float()]), TypeError,
             "indices[0] has dtype"),
        case("index range", lambda p, g, m, v, idx: (p, g, m, v, [idx[0] + 12]), ValueError,
             "must be in [0, 12)"),
        case("negative index", lambda p, g, m, v, idx: (p, g, m, v, [idx[0] - 100]), ValueError,
             "must be in [0, 12)"),
        case("unsorted", lambda p, g, m, v, idx: (p, g, m, v, [idx[0].flip(0)]), ValueError,
             "sorted and unique"),
        case("duplicate", duplicate, ValueError, "sorted and unique"),
        case("state shape", lambda p, g, m, v, idx: (p, g, [m[0][:-1]], v, idx), ValueError,
             "exp_avgs[0] has shape"),
        case("columns state", lambda p, g, m, v, idx: (p, g, m, [v[0].t().contiguous()], idx),
             ValueError, "exp_avg_sqs[0] has shape", shape_kind="columns", kind="columns"),
        case("too many", lambda p, g, m, v, idx: (p, g, m, v, [torch.arange(13)]), ValueError,
             "13 entries"),
        case("lists", lambda p, g, m, v, idx: (p, g, m, v, idx + idx), ValueError, "2 indices"),
    )


def _frugal_opcheck(kind):
    def make():
        params, grads, m, v, idx = frugal_case(kind, (9, 13), torch.float32, 0.4, seed=12)
        return (params, grads, m, v, idx, kind, torch.tensor(1e-3), 0.9, 0.999, 1e-8, 0.01,
                torch.tensor(2.0), "sign", 1.0, *grad_scaler_args(), "auto")
    return make


FRUGAL_STEP = OpInfo(
    name="frugal_step_", op=ops.frugal_step_, ref=reference.frugal_step_,
    outputs=("params", "exp_avgs", "exp_avg_sqs"), output_positions=(0, 2, 3), num_lists=5,
    samples=(
        *(SampleInput(f"{kind}{shape}", _frugal(kind, shape, 0.25, seed=sum(shape)), steps=2)
          for kind, shape in FRUGAL_CASES),
        *(SampleInput(f"{kind} density={density} {str(index_dtype).replace('torch.', '')}",
                      _frugal(kind, (33, 70), density, 7, index_dtype), steps=2, dtypes=FP32)
          for kind in SUBSET_KINDS for density in (0.0, 1.0, 0.6)
          for index_dtype in (torch.int32, torch.int64)),
        *(SampleInput(f"{kind} state_free={rule}",
                      _frugal(kind, (40, 50), 0.3, 8, state_free=rule, state_free_scale=0.25),
                      steps=2, dtypes=FP32)
          for rule in STATE_FREE_RULES for kind in SUBSET_KINDS),
        *(SampleInput(f"{kind} large", _frugal(kind, _large_shape, 0.25, 9), dtypes=FP32)
          for kind in SUBSET_KINDS),
        SampleInput("columns, many tensors, mixed sizes and empty", _frugal_many, steps=5,
                    dtypes=(torch.bfloat16,)),
    ),
    error_inputs=_frugal_errors(),
    opcheck_inputs=tuple((kind, _frugal_opcheck(kind)) for kind in SUBSET_KINDS),
    empty_kwargs={**FRUGAL_HYPER, "kind": "rows", "step": 1},
    compare=compare_close, counts_steps=True, tensor_scalar_sample="rows(37, 130)",
    isa_variants=({"state_free": "sign"}, {"state_free": "sgd"}),
)

# ---------------------------------------------------------------- frugal_step_int8_

# (kind, shape): rows walked in place (2-D, 3-D) and gathered (1-D), columns of rows
# shorter and longer than a quantization block of 256, of a 3-D tensor and of a 1-D one.
FRUGAL_INT8_CASES = [
    ("rows", (37, 300)),
    ("rows", (4097,)),
    ("rows", (5, 3, 70)),
    ("columns", (37, 130)),
    ("columns", (5, 3000)),
    ("columns", (3, 4, 500)),
    ("columns", (700,)),
]


def frugal_int8_case(kind, shape, dtype, density, seed, index_dtype=torch.int64):
    """(params, grads, m codes, m scales, v codes, v scales, indices) of one tensor: the
    moments of frugal_case quantized."""
    params, grads, _, _, idx = frugal_case(kind, shape, dtype, density, seed, index_dtype)
    st = state_shape(params[0], kind, idx[0].numel())
    return (params, grads, *int8_moments([torch.empty(st)], seed), idx)


def _frugal_int8(kind, shape, density, seed, index_dtype=torch.int64, **options):
    """A sample maker; ``shape`` may depend on the backend (a callable)."""
    def make(dtype, backend):
        s = shape(backend) if callable(shape) else shape
        return (frugal_int8_case(kind, s, dtype, density, seed, index_dtype),
                {**FRUGAL_HYPER, "kind": kind, **options})
    return make


def _frugal_int8_many(dtype, backend):
    shapes = [(7, 9), (0, 5), (300, 40), (1, 1), (64, 700), (2, 0)]
    lists = [[] for _ in range(7)]
    for i, shape in enumerate(shapes):
        for lst, part in zip(lists, frugal_int8_case("columns", shape, dtype, 0.5, seed=i)):
            lst += part
    return tuple(lists), {**FRUGAL_HYPER, "kind": "columns"}


def _frugal_int8_errors():
    def case(name, change, error, match, shape_kind="rows", **overrides):
        def make():
            args = frugal_int8_case(shape_kind, (12, 300), torch.float32, 0.5, seed=11)
            return change(*args), {**FRUGAL_HYPER, "kind": shape_kind, "step": 1, **overrides}
        return ErrorInput(name, make, error, match)

    def flat(p, g, m, ms, v, vs, idx):
        return p, g, m, ms, v, vs, [torch.arange(3)]

    same = (lambda *a: a)
    return (
        case("flat refused", flat, ValueError, "blocks would straddle the tensor's rows",
             kind="flat"),
        case("kind", same, ValueError, "kind must be one of", kind="diagonal"),
        case("fp32 moments", lambda p, g, m, ms, v, vs, idx: (p, g, [x.float() for x in m], ms,
                                                             v, vs, idx),
             TypeError, "exp_avgs[0] has dtype"),
        case("scale shape", lambda p, g, m, ms, v, vs, idx: (p, g, m, ms, v, [vs[0][:, :1]], idx),
             ValueError, "exp_avg_sq_scales[0] has shape (6, 1) but must have shape (6, 2)"),
        case("codes of the whole tensor",
             lambda p, g, m, ms, v, vs, idx: (p, g, [torch.zeros(12, 300, dtype=torch.int8)], ms,
                                              v, vs, idx),
             ValueError, "exp_avgs[0] has shape (12, 300) but must have shape (6, 300)"),
        case("rows state for columns", same, ValueError,
             "exp_avgs[0] has shape (6, 300) but must have shape (12, 6)", kind="columns"),
        case("index range", lambda p, g, m, ms, v, vs, idx: (p, g, m, ms, v, vs, [idx[0] + 12]),
             ValueError, "must be in [0, 12)"),
        case("unsorted", lambda p, g, m, ms, v, vs, idx: (p, g, m, ms, v, vs, [idx[0].flip(0)]),
             ValueError, "sorted and unique"),
        case("lists", lambda p, g, m, ms, v, vs, idx: (p, g, m, ms[:0], v, vs, idx), ValueError,
             "0 exp_avg_scales"),
        case("step 0", same, ValueError, "step counts updates from 1", step=0),
    )


def _frugal_int8_opcheck(kind):
    def make():
        return (*frugal_int8_case(kind, (9, 300), torch.float32, 0.4, seed=12), kind,
                torch.tensor(1e-3), 0.9, 0.999, 1e-8, 0.01, torch.tensor(2.0), "sign", 1.0,
                *grad_scaler_args(), "auto")
    return make


FRUGAL_STEP_INT8 = OpInfo(
    name="frugal_step_int8_", op=ops.frugal_step_int8_, ref=reference.frugal_step_int8_,
    outputs=("params", "exp_avgs", "exp_avg_scales", "exp_avg_sqs", "exp_avg_sq_scales"),
    output_positions=(0, 2, 3, 4, 5), num_lists=7,
    samples=(
        *(SampleInput(f"{kind}{shape}", _frugal_int8(kind, shape, 0.25, seed=sum(shape)),
                      steps=3)
          for kind, shape in FRUGAL_INT8_CASES),
        *(SampleInput(f"{kind} density={density} {str(index_dtype).replace('torch.', '')}",
                      _frugal_int8(kind, (33, 270), density, 7, index_dtype), steps=2,
                      dtypes=FP32)
          for kind in ("rows", "columns") for density in (0.0, 1.0, 0.6)
          for index_dtype in (torch.int32, torch.int64)),
        *(SampleInput(f"{kind} state_free={rule}",
                      _frugal_int8(kind, (40, 300), 0.3, 8, state_free=rule,
                                   state_free_scale=0.25), steps=2, dtypes=FP32)
          for rule in STATE_FREE_RULES for kind in ("rows", "columns")),
        *(SampleInput(f"{kind} large", _frugal_int8(kind, _large_shape, 0.25, 9), dtypes=FP32)
          for kind in ("rows", "columns")),
        SampleInput("columns, many tensors, mixed sizes and empty", _frugal_int8_many, steps=5,
                    dtypes=(torch.bfloat16,)),
    ),
    error_inputs=_frugal_int8_errors(),
    opcheck_inputs=tuple((kind, _frugal_int8_opcheck(kind)) for kind in ("rows", "columns")),
    empty_kwargs={**FRUGAL_HYPER, "kind": "rows", "step": 1},
    compare=compare_exact, counts_steps=True, tensor_scalar_sample="rows(37, 300)",
    isa_variants=({"state_free": "sign"}, {"state_free": "sgd"}),
)

# ---------------------------------------------------------------- lowrank_step_

LOWRANK_HYPER = dict(lr=1e-2, weight_decay=0.1, state_free_scale=0.5)


def lowrank_case(shape, rank, side, dtype=torch.float32, seed=0):
    """(param, grad, low_update, low_grad, projection) of one tensor seen as [m, n]."""
    gen = torch.Generator().manual_seed(seed)
    m = shape[0]
    n = 1
    for d in shape[1:]:
        n *= d
    p = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    dim = n if side == RIGHT else m
    q, _ = torch.linalg.qr(torch.randn(dim, rank, generator=gen))
    proj = q.t().contiguous() if side == RIGHT else q.contiguous()
    g2 = g.float().reshape(m, n)
    low_grad = g2 @ proj.t() if side == RIGHT else proj.t() @ g2
    low_update = torch.randn(low_grad.shape, generator=gen) * 1e-3
    return p, g, low_update, low_grad, proj


def fraction_apart(a, b, tol):
    if a.numel() == 0:
        return 0.0
    return ((a.float() - b.float()).abs() > tol).float().mean().item()


def compare_lowrank(actual, expected, dtype, what):
    for i, (a, e) in enumerate(zip(actual, expected)):
        if dtype == torch.float32:
            # GEMMs round differently per backend; a sign taken of a residual near
            # zero can flip (DESIGN.md section 6): count the coordinates that moved
            # apart by more than rounding.
            apart = fraction_apart(a, e, 1e-5)
            assert apart <= 0.002, f"{what}[{i}]: {apart:.2%} of coordinates apart"
        else:
            apart = fraction_apart(a, e, 0)
            assert apart <= 0.01 or ulp_diff(a, e) <= 1, \
                f"{what}[{i}] ({dtype}): {apart:.2%} of coordinates apart, beyond one ulp"


def compare_allclose(actual, expected, dtype, what):
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert torch.allclose(a, e, rtol=0, atol=1e-5), f"{what}[{i}]"


def _lowrank_one(shape, rank, side, **options):
    def make(dtype, backend):
        p, g, u, lg, proj = lowrank_case(shape, rank, side, dtype, seed=rank)
        return ([p], [g], [u], [lg], [proj], [side]), {**LOWRANK_HYPER, **options}
    return make


def _lowrank_many(dtype, backend):
    specs = [((20, 10), 3, RIGHT), ((10, 20), 3, LEFT), ((16, 16), 16, RIGHT)]
    cases = [lowrank_case(s, r, side, dtype, seed=i) for i, (s, r, side) in enumerate(specs)]
    lists = tuple([c[k] for c in cases] for k in range(5))
    return (*lists, [side for _, _, side in specs]), dict(lr=0.1, weight_decay=0.0,
                                                         state_free="sgd")


def _lowrank_empty(shape, side):
    def make(dtype, backend):
        p = torch.empty(shape, dtype=dtype)
        m, n = shape[0], shape[1] * (shape[2] if len(shape) > 2 else 1)
        proj = torch.zeros((1, n) if side == RIGHT else (m, 1))
        low = torch.zeros((m, 1) if side == RIGHT else (1, n))
        return ([p], [p.clone()], [low], [low.clone()], [proj], [side]), \
            dict(lr=0.1, weight_decay=0.0)
    return make


LOWRANK_SHAPES = [((64, 48), 12, RIGHT), ((48, 64), 12, LEFT), ((33, 7), 2, RIGHT),
                  ((5, 70), 1, LEFT), ((4, 6, 5), 3, RIGHT), ((130, 150), 37, LEFT)]


LOWRANK_EMPTY = [((0, 5), RIGHT), ((5, 0), LEFT), ((0, 3, 4), RIGHT)]


def _side_name(side):
    return "right" if side == RIGHT else "left"


def _lowrank_errors():
    def case(name, change, error, match):
        def make():
            return change(lowrank_case((12, 8), 3, RIGHT)), dict(lr=0.1)
        return ErrorInput(name, make, error, match)

    return (
        case("1-D tensor", lambda c: ([c[0][0]], [c[1][0]], [c[2]], [c[3]], [c[4]], [RIGHT]),
             ValueError, "1 dims"),
        case("low update dtype",
             lambda c: ([c[0]], [c[1]], [c[2].double()], [c[3]], [c[4]], [RIGHT]), TypeError,
             "low_updates[0] has dtype"),
        case("wrong side", lambda c: ([c[0]], [c[1]], [c[2]], [c[3]], [c[4]], [LEFT]),
             ValueError, "must have shape"),
        case("sides length", lambda c: ([c[0]], [c[1]], [c[2]], [c[3]], [c[4]], [RIGHT, RIGHT]),
             ValueError, "2 sides"),
        case("side value", lambda c: ([c[0]], [c[1]], [c[2]], [c[3]], [c[4]], [7]), ValueError,
             "sides[0] must be"),
    )


def _lowrank_opcheck():
    p, g, u, lg, proj = lowrank_case((12, 8), 3, RIGHT)
    return ([p], [g], [u], [lg], [proj], [RIGHT], torch.tensor(0.1), 0.01, "sign", 1.0,
            *grad_scaler_args(), "auto")


LOWRANK_STEP = OpInfo(
    name="lowrank_step_", op=ops.lowrank_step_, ref=reference.lowrank_step_,
    outputs=("params",), output_positions=(0,), num_lists=6,
    samples=(
        *(SampleInput(f"{shape} rank={rank} {_side_name(side)} state_free={rule}",
                      _lowrank_one(shape, rank, side, state_free=rule))
          for shape, rank, side in LOWRANK_SHAPES for rule in STATE_FREE_RULES),
        SampleInput("many tensors", _lowrank_many, dtypes=FP32, compare=compare_allclose),
        *(SampleInput(f"empty {shape} {_side_name(side)}", _lowrank_empty(shape, side))
          for shape, side in LOWRANK_EMPTY),
    ),
    error_inputs=_lowrank_errors(),
    opcheck_inputs=(("one tensor", _lowrank_opcheck),),
    empty_kwargs=dict(lr=0.1, weight_decay=0.0),
    compare=compare_lowrank, tensor_scalar_sample="many tensors",
)

# ---------------------------------------------------------------- lowrank_adamw_step_

LOWRANK_ADAMW_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                           state_free_scale=0.5)


def lowrank_adamw_case(shape, rank, side, dtype=torch.float32, seed=0):
    """(param, grad, exp_avg, exp_avg_sq, projection) of one tensor seen as [m, n], with
    moments of earlier steps."""
    p, g, _, low_grad, proj = lowrank_case(shape, rank, side, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    m = torch.randn(low_grad.shape, generator=gen) * 0.1
    v = torch.rand(low_grad.shape, generator=gen) * 0.1
    return p, g, m, v, proj


def compare_lowrank_adamw(actual, expected, dtype, what):
    """The params as lowrank_step_'s (signs of residuals near zero may flip); the
    moments, which see the projected gradient only, to GEMM rounding: relative to the
    largest moment (an entry can be the small difference of two large products)."""
    if what == "params":
        compare_lowrank(actual, expected, dtype, what)
        return
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e.numel():
            apart = (a - e).abs().max().item()
            assert apart <= 1e-5 * max(1.0, e.abs().max().item()), f"{what}[{i}]: {apart:.3g}"


def _lowrank_adamw_lists(specs, dtype):
    cases = [lowrank_adamw_case(s, r, side, dtype, seed=i) for i, (s, r, side) in enumerate(specs)]
    return (*([c[k] for c in cases] for k in range(5)), [side for _, _, side in specs])


def _lowrank_adamw_one(shape, rank, side, **options):
    def make(dtype, backend):
        return _lowrank_adamw_lists([(shape, rank, side)], dtype), \
            {**LOWRANK_ADAMW_HYPER, **options}
    return make


def _lowrank_adamw_many(dtype, backend):
    # Three stacks' worth of LLaMA-like small shapes and a full-rank one, with an empty
    # tensor among them.
    specs = [((16, 6), 2, RIGHT), ((6, 16), 2, LEFT), ((6, 6), 2, RIGHT), ((16, 6), 2, RIGHT),
             ((0, 6), 1, RIGHT), ((12, 12), 12, LEFT)]
    # An lr that float32 holds exactly: the tensor-scalar test passes it as a float32
    # tensor, and 0.01 rounded to float32 gives another AdamW step size at step 2.
    return _lowrank_adamw_lists(specs, dtype), {**LOWRANK_ADAMW_HYPER, "lr": 2**-7,
                                                "state_free": "sgd"}


def _lowrank_adamw_empty(dtype, backend):
    """Empty params whose moments are not empty: a [0, n] tensor at side LEFT has moments
    [r, n], a [m, 0] one at side RIGHT [m, r]; they see a zero projected gradient."""
    gen = torch.Generator().manual_seed(5)
    specs = [((0, 5), LEFT, (0, 1), (1, 5)), ((5, 0), RIGHT, (1, 0), (5, 1)),
             ((0, 3, 4), LEFT, (0, 2), (2, 12))]
    lists = [[], [], [], [], [], []]
    for shape, side, proj, state in specs:
        p = torch.empty(shape, dtype=dtype)
        parts = (p, p.clone(), torch.randn(state, generator=gen) * 0.1,
                 torch.rand(state, generator=gen) * 0.1, torch.zeros(proj), side)
        for lst, part in zip(lists, parts):
            lst.append(part)
    return tuple(lists), dict(LOWRANK_ADAMW_HYPER)


def _lowrank_adamw_errors():
    def case(name, change, error, match, **overrides):
        def make():
            args = _lowrank_adamw_lists([((12, 8), 3, RIGHT)], torch.float32)
            return change(*args), {**LOWRANK_ADAMW_HYPER, "step": 1, **overrides}
        return ErrorInput(name, make, error, match)

    same = (lambda *a: a)
    return (
        case("1-D tensor", lambda p, g, m, v, P, s: ([p[0][0]], [g[0][0]], m, v, P, s),
             ValueError, "1 dims"),
        case("moment shape", lambda p, g, m, v, P, s: (p, g, [m[0][:5]], v, P, s),
             ValueError, "exp_avgs[0] has shape"),
        case("moment dtype", lambda p, g, m, v, P, s: (p, g, m, [v[0].double()], P, s),
             TypeError, "exp_avg_sqs[0] has dtype"),
        case("projection dtype", lambda p, g, m, v, P, s: (p, g, m, v, [P[0].double()], s),
             ValueError, "must be a float32 matrix"),
        case("non-contiguous projection",
             lambda p, g, m, v, P, s: (p, g, m, v, [P[0].t().contiguous().t()], s),
             ValueError, "projections[0] is not contiguous"),
        case("wrong side", lambda p, g, m, v, P, s: (p, g, m, v, P, [LEFT]), ValueError,
             "must have shape"),
        case("side value", lambda p, g, m, v, P, s: (p, g, m, v, P, [7]), ValueError,
             "sides[0] must be"),
        case("sides length", lambda p, g, m, v, P, s: (p, g, m, v, P, [RIGHT, RIGHT]),
             ValueError, "2 sides"),
        case("step 0", same, ValueError, "step counts updates from 1", step=0),
        case("beta", same, ValueError, "beta2", beta2=1.0),
        case("state_free", same, ValueError, "state_free must be", state_free="adam"),
    )


def _lowrank_adamw_opcheck():
    args = _lowrank_adamw_lists([((12, 8), 3, RIGHT), ((5, 9), 2, LEFT)], torch.float32)
    return (*args, torch.tensor(1e-2), 0.9, 0.999, 1e-8, 0.1, torch.tensor(3.0), "sign", 0.5,
            *grad_scaler_args(), "auto")


LOWRANK_ADAMW_STEP = OpInfo(
    name="lowrank_adamw_step_", op=ops.lowrank_adamw_step_, ref=reference.lowrank_adamw_step_,
    outputs=("params", "exp_avgs", "exp_avg_sqs"), output_positions=(0, 2, 3), num_lists=6,
    samples=(
        *(SampleInput(f"{shape} rank={rank} {_side_name(side)} state_free={rule}",
                      _lowrank_adamw_one(shape, rank, side, state_free=rule), steps=3)
          for shape, rank, side in LOWRANK_SHAPES for rule in STATE_FREE_RULES),
        SampleInput("many small tensors", _lowrank_adamw_many, steps=5, first_step=2),
        SampleInput("empty params, moments that are not", _lowrank_adamw_empty, steps=2),
    ),
    error_inputs=_lowrank_adamw_errors(),
    opcheck_inputs=(("two tensors", _lowrank_adamw_opcheck),),
    empty_kwargs={**LOWRANK_ADAMW_HYPER, "step": 1},
    compare=compare_lowrank_adamw, counts_steps=True, tensor_scalar_sample="many small tensors",
    isa_variants=({"state_free": "sign"}, {"state_free": "sgd"}),
)

# ---------------------------------------------------------------- dqt_update_

DQT_HYPER = dict(lr=2e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, rng_step=11)


def dqt_case(shape, bits, kind, density, dtype, seed, per_row=False, index_dtype=torch.int64):
    """(codes, scales, grads, exp_avgs, exp_avg_sqs, indices) of one weight of ``shape``:
    random codes over the whole range, a scale per tensor or per row."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    top = _quant.qmax(bits)
    q = torch.randint(-top, top + 1, shape, generator=gen)
    scales = torch.rand(rows if per_row else 1, generator=gen) * 0.02 + 0.01
    grads = (torch.randn(shape, generator=gen) * 0.3).to(dtype)
    idx = subset(shape, kind, density, seed, index_dtype)
    st = state_shape(grads, kind, idx.numel())
    m = torch.randn(st, generator=gen) * 0.1
    v = torch.rand(st, generator=gen) * 0.1
    return [_quant.pack(q, bits)], [scales], [grads], [m], [v], [idx]


def _dqt(shape, bits, kind, density, seed, per_row=False, **options):
    def make(dtype, backend):
        case = dqt_case(shape, bits, kind, density, dtype, seed, per_row)
        return case, {**DQT_HYPER, "bits": bits, "kind": kind, "seeds": [seed], **options}
    return make


def _dqt_many(dtype, backend):
    shapes = [(7, 9), (0, 5), (30, 41), (1, 1), (3, 2100), (2, 0)]
    lists = [[], [], [], [], [], []]
    for i, shape in enumerate(shapes):
        for lst, part in zip(lists, dqt_case(shape, 3, "columns", 0.5, dtype, i, i % 2 == 0)):
            lst += part
    return tuple(lists), {**DQT_HYPER, "bits": 3, "kind": "columns",
                          "seeds": [2**32 - 1 - i for i in range(len(shapes))]}


def compare_dqt(actual, expected, dtype, what):
    """The codes to the bit (the same rounding decisions on every backend); the
    moments as for frugal_step_."""
    if actual and actual[0].dtype == torch.uint8:
        for i, (a, e) in enumerate(zip(actual, expected)):
            apart = (a != e).sum().item()
            assert apart == 0, f"{what}[{i}]: {apart} bytes of codes differ"
    else:
        assert_params_close(actual, expected, what=what)


def _dqt_errors():
    def case(name, change, error, match, **overrides):
        def make():
            args = dqt_case((12, 10), 4, "rows", 0.5, torch.float32, seed=13)
            return change(*args), {**DQT_HYPER, "bits": 4, "kind": "rows", "seeds": [1],
                                   "step": 1, **overrides}
        return ErrorInput(name, make, error, match)

    same = (lambda *a: a)
    return (
        case("bits", same, ValueError, "bits must be one of", bits=5),
        case("codes dtype", lambda q, s, g, m, v, i: ([q[0].to(torch.int8)], s, g, m, v, i),
             TypeError, "codes[0] has dtype"),
        case("codes shape", lambda q, s, g, m, v, i: ([q[0][:, :-1]], s, g, m, v, i),
             ValueError, "packs to (12, 5)"),
        case("codes of other bits", same, ValueError, "packs to (12, 3)", bits=2),
        case("scale shape", lambda q, s, g, m, v, i: (q, [torch.ones(5)], g, m, v, i),
             ValueError, "scales[0] has shape (5,)"),
        case("scale dtype", lambda q, s, g, m, v, i: (q, [s[0].double()], g, m, v, i),
             TypeError, "scales[0] has dtype"),
        case("1-D grad", lambda q, s, g, m, v, i: (q, s, [g[0].view(-1)], m, v, i),
             ValueError, "2-D weight gradient"),
        case("state shape", lambda q, s, g, m, v, i: (q, s, g, [m[0][:-1]], v, i), ValueError,
             "exp_avgs[0] has shape"),
        case("index range", lambda q, s, g, m, v, i: (q, s, g, m, v, [i[0] + 12]), ValueError,
             "must be in [0, 12)"),
        case("seeds length", same, ValueError, "2 seeds", seeds=[1, 2]),
        case("seed range", same, ValueError, "seeds[0] must be in", seeds=[-1]),
        case("rng_step range", same, ValueError, "rng_step must be in", rng_step=2**32),
        case("lists", lambda q, s, g, m, v, i: (q, s + s, g, m, v, i), ValueError, "2 scales"),
    )


def _dqt_opcheck(kind):
    def make():
        args = dqt_case((9, 13), 3, kind, 0.4, torch.float32, seed=12, per_row=True)
        return (*args, kind, [7], 3, torch.tensor(1e-2), 0.9, 0.999, 1e-8, 0.01,
                torch.tensor(2.0), "sign", 1.0, 5, *grad_scaler_args(), "auto")
    return make


# (bits, kind, density, shape): every code width over each subset kind; rows of
# 3 bits whose fields straddle bytes and end mid-byte; rows longer than a CPU
# segment of 2048 columns; plain AdamW (every row) and plain SignSGD (none).
DQT_CASES = [
    (2, "columns", 0.25, (37, 130)),
    (3, "rows", 0.25, (11, 2053)),
    (4, "flat", 0.25, (60, 70)),
    (8, "columns", 0.25, (5, 5000)),
    (4, "rows", 1.0, (33, 19)),
    (2, "rows", 0.0, (33, 19)),
    (3, "columns", 0.6, (17, 23)),
    (8, "flat", 0.1, (4097, 1)),
]

DQT_UPDATE = OpInfo(
    name="dqt_update_", op=ops.dqt_update_, ref=reference.dqt_update_,
    outputs=("codes", "exp_avgs", "exp_avg_sqs"), output_positions=(0, 3, 4), num_lists=6,
    samples=(
        *(SampleInput(f"bits={bits} {kind} density={density} {shape}",
                      _dqt(shape, bits, kind, density, seed=sum(shape) + bits), steps=3)
          for bits, kind, density, shape in DQT_CASES),
        *(SampleInput(f"bits={bits} per-row scales state_free={rule}",
                      _dqt((40, 50), bits, "rows", 0.3, 8, per_row=True, state_free=rule,
                           state_free_scale=0.5), steps=2, dtypes=FP32)
          for bits in _quant.QUANT_BITS for rule in STATE_FREE_RULES),
        SampleInput("many weights, mixed sizes and empty", _dqt_many, steps=3),
    ),
    error_inputs=_dqt_errors(),
    opcheck_inputs=tuple((kind, _dqt_opcheck(kind)) for kind in SUBSET_KINDS),
    empty_kwargs={**DQT_HYPER, "bits": 4, "kind": "rows", "seeds": [], "step": 1},
    compare=compare_dqt, counts_steps=True, tensor_scalar_sample="bits=3 rows density=0.25 (11, 2053)",
    isa_variants=({"state_free": "sign"}, {"state_free": "sgd"}),
    grad_position=2,
)

OPS = (ADAMW, ADAMW_INT8, SIGN_SGD, SGD, FRUGAL_STEP, FRUGAL_STEP_INT8, LOWRANK_STEP,
       LOWRANK_ADAMW_STEP, DQT_UPDATE)

# The ops outside the table: out of place and not optimizer steps (no lists, no lr
# or step), which the generic tests do not fit; each gets the table's checks
# (every CPU backend against the reference, odd and empty sizes, bad input,
# opcheck) in its own file, and the Triton kernel's geometry in tests/triton_backend/.
OUT_OF_PLACE_OPS = {
    "dequantize": "tests/ops/test_dequantize.py",
    "quant_matmul": "tests/ops/test_quant_matmul.py",
    "linear_cross_entropy": "tests/ops/test_linear_cross_entropy.py",
    "grad_norm": "tests/ops/test_grad_norm.py",
}
