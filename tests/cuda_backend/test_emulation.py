"""The CUDA kernels, emulated on the CPU, against the CPU kernels, bit for bit.

``_C.<op>_cuda_emulated`` runs the block bodies of the CUDA kernels
(csrc/cuda/*.cuh) over an emulated grid with the launch planner of the real
launches, so every index, chunking and vector-path decision of the kernels is
checked here without a GPU. Both sides apply the same update rules in the same
order of operations, so params and states must be *equal*, not close.

The sizes are chosen around the kernels' constants (cases.py); the tests
that must cross a launch limit assert the number of launches the emulator
reports, so that they fail rather than silently stop covering it when a
constant changes.
"""

import contextlib
import importlib
import math
import os
import shutil
import types

import pytest
import torch

import frugal_kernels
from frugal_kernels._layout import STATE_FREE_CODES, STATE_FREE_RULES
from frugal_kernels._quant import QUANT_BITS
from frugal_kernels.ops import (adamw, adamw_int8, dqt_update, frugal_step, frugal_step_int8,
                                sign_sgd)
from frugal_kernels.ops._common import kernel_batch, subset_batch

from .cases import (_C, BETA1, BETA2, CHUNK, DQT_CHUNK, DQT_SHAPES, DQT_TILE, DTYPES, EPS,
                    FRUGAL_INT8_SHAPES, FRUGAL_SHAPES, GN_CHUNK, GN_SIZES, INT8_CHUNK,
                    INT8_SHAPES, LR, SIZES, STEP, TILE, WD, adamw_data, adamw_int8_data,
                    assert_equal, dqt_data, dqt_padded, frugal_data, frugal_int8_data,
                    grad_norm_data, grad_norm_partials, launches_for, moment_blocks, placed,
                    sign_sgd_data)

# The module, which ops.grad_norm (the function) hides as an attribute of ops.
grad_norm = importlib.import_module("frugal_kernels.ops.grad_norm")


def placed_lists(data, names, misaligned):
    """The lists of ``data`` placed in memory, those named in ``misaligned``
    one element past 16-byte alignment."""
    return [[placed(t, misaligned=name in misaligned) for t in ts] for name, ts in zip(names, data)]


# ----------------------------------------------------------------- adamw_

class AdamWCase:
    def __init__(self, numels, dtype, *, seed=0, misaligned=(), maximize=False):
        self.dtype, self.maximize = dtype, maximize
        self.p, self.g, self.m, self.v = placed_lists(adamw_data(numels, dtype, seed), "pgmv",
                                                      misaligned)

    def hyper(self, lr=LR, step=STEP):
        return _C.AdamWHyper(lr=lr, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, step=step,
                             maximize=self.maximize, grad_scale=1.0, found_inf=0.0)

    def run_cpu(self):
        p, m, v = ([t.clone() for t in ts] for ts in (self.p, self.m, self.v))
        _C.adamw_cpu(kernel_batch(_C, p, self.g, m, v), self.hyper(), torch.get_num_threads())
        return p, m, v

    def run_emulated(self, lr=LR, step=STEP, lr_ptr=0, step_ptr=0):
        return _C.adamw_cuda_emulated(kernel_batch(_C, self.p, self.g, self.m, self.v),
                                      self.hyper(lr, step),
                                      _C.DeviceScalars(lr=lr_ptr, step=step_ptr))

    def check(self, **kw):
        want = self.run_cpu()
        launches = self.run_emulated(**kw)
        for name, got, w in zip(("params", "exp_avgs", "exp_avg_sqs"), (self.p, self.m, self.v),
                                want):
            assert_equal(name, got, w)
        return launches


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adamw_sizes(dtype, misaligned):
    case = AdamWCase(SIZES, dtype, misaligned=("p", "g", "m", "v") if misaligned else ())
    assert case.check() == 1


def test_adamw_maximize():
    assert AdamWCase([5, CHUNK + 3], torch.float32, maximize=True).check() == 1


@pytest.mark.parametrize("which", ["p", "g", "m", "v"])
def test_adamw_one_misaligned_list_takes_the_scalar_path(which):
    # The emulator raises on a 16-byte access at a misaligned address, so
    # this fails if any pointer is left out of the alignment check.
    AdamWCase([CHUNK + 9], torch.bfloat16, misaligned=(which,)).check()


def test_adamw_more_tensors_than_one_launch_holds():
    gen = torch.Generator().manual_seed(1)
    numels = [int(n) for n in torch.randint(1, 3 * TILE, (100,), generator=gen)]
    numels[10] = numels[50] = 0
    launches = AdamWCase(numels, torch.float16, seed=1).check()
    assert launches == launches_for("adamw", numels) >= 3


def test_adamw_more_blocks_than_one_launch_holds():
    # 382 chunks: the first tensor spans two launches and the next ones join
    # it in the second, where it must still be found in its table slot.
    numels = [350 * CHUNK + 3, 5, 30 * CHUNK]
    launches = AdamWCase(numels, torch.bfloat16, seed=2).check()
    assert launches == launches_for("adamw", numels) == 2


# lr and step as float32, what a device tensor holds (both exactly).
LR32 = torch.tensor(LR, dtype=torch.float32)
STEP32 = torch.tensor(STEP, dtype=torch.float32)
BY_VALUE = {"lr": LR, "step": STEP}


def by_pointer(which):
    """Emulated-call arguments that pass lr and/or step by host address. The
    value beside a pointer is junk, as the ops layer passes 0.0: the pointer
    must win."""
    kw = dict(BY_VALUE)
    if which in ("lr", "both"):
        kw.update(lr=0.0, lr_ptr=LR32.data_ptr())
    if which in ("step", "both"):
        kw.update(step=0.0, step_ptr=STEP32.data_ptr())
    return kw


@pytest.mark.parametrize("which", ["lr", "step", "both"])
def test_adamw_device_scalars(which):
    values = AdamWCase([CHUNK + 5, 77], torch.bfloat16, seed=3)
    pointers = AdamWCase([CHUNK + 5, 77], torch.bfloat16, seed=3)
    values.run_emulated(**BY_VALUE)
    pointers.run_emulated(**by_pointer(which))
    for name in ("p", "m", "v"):
        assert_equal(name, getattr(pointers, name), getattr(values, name))


# ------------------------------------------------------------ adamw_int8_

INT8_LISTS = ("params", "exp_avgs", "exp_avg_scales", "exp_avg_sqs", "exp_avg_sq_scales")
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.int8: torch.int8, torch.uint8: torch.uint8}


def assert_same_bits(name, got, want):
    """assert_equal on the bit patterns: NaN scales and moments must agree too."""
    assert_equal(name, [t.view(_BITS[t.dtype]) for t in got],
                 [t.view(_BITS[t.dtype]) for t in want])


class AdamWInt8Case:
    """params, grads and 8-bit moments placed in memory, by list initial: p, g, m (codes),
    s (their scales), v, w (their scales); those in ``misaligned`` one element off."""

    def __init__(self, shapes, dtype, *, seed=0, misaligned=(), maximize=False):
        self.shapes, self.dtype, self.maximize = shapes, dtype, maximize
        self.lists = placed_lists(adamw_int8_data(shapes, dtype, seed), "pgmsvw", misaligned)

    def hyper(self, lr=LR, step=STEP, grad_scale=1.0):
        return _C.AdamWHyper(lr=lr, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, step=step,
                             maximize=self.maximize, grad_scale=grad_scale, found_inf=0.0)

    def call(self, lists, grads=None, **hyper):
        """The binding's arguments but the DeviceScalars, with the lists as given."""
        t = adamw_int8.Tensors(lists[0], self.lists[1] if grads is None else grads, *lists[2:])
        return (kernel_batch(_C, t.params, t.grads), adamw_int8.moments8_batch(_C, t),
                self.hyper(**hyper))

    def written(self):
        return [self.lists[i] for i in (0, 2, 3, 4, 5)]

    def run_cpu(self):
        lists = [[t.clone() for t in ts] for ts in self.lists]
        _C.adamw_int8_cpu(*self.call(lists), torch.get_num_threads())
        return [lists[i] for i in (0, 2, 3, 4, 5)]

    def run_emulated(self, grads=None, pointers=None, **hyper):
        """``pointers``: the DeviceScalars' host addresses, by name."""
        return _C.adamw_int8_cuda_emulated(*self.call(self.lists, grads, **hyper),
                                           _C.DeviceScalars(**(pointers or {})))

    def check(self):
        before = [[t.clone() for t in ts] for ts in self.written()]
        want = self.run_cpu()
        launches = self.run_emulated()
        for name, got, w in zip(INT8_LISTS, self.written(), want):
            assert_same_bits(name, got, w)
        for name, got, b in zip(INT8_LISTS, self.written(), before):
            moved = sum(not torch.equal(x, y) for x, y in zip(got, b) if x.numel())
            assert moved > 0, f"no {name} changed"
        return launches


@pytest.mark.parametrize("misaligned", [(), ("p", "g"), ("m", "v"), ("p", "g", "m", "v")],
                         ids=["aligned", "pg-misaligned", "codes-misaligned", "misaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adamw_int8_shapes(dtype, misaligned):
    case = AdamWInt8Case(INT8_SHAPES, dtype, misaligned=misaligned)
    assert case.check() == launches_for("adamw_int8", moment_blocks(INT8_SHAPES)) == 1


@pytest.mark.parametrize("which", ["p", "g", "m", "v"])
def test_adamw_int8_one_misaligned_list_takes_the_scalar_path(which):
    # The emulator raises on a vector access at a misaligned address, so this fails
    # if any pointer is left out of the alignment check.
    AdamWInt8Case([(3, 2 * 256), (INT8_CHUNK + 1) * 256], torch.bfloat16,
                  misaligned=(which,)).check()


def test_adamw_int8_maximize():
    assert AdamWInt8Case([(4, 300), 5], torch.float16, maximize=True).check() == 1


def test_adamw_int8_more_tensors_than_one_launch_holds():
    gen = torch.Generator().manual_seed(14)
    shapes = [(int(r), int(c)) for r, c in torch.randint(1, 300, (70, 2), generator=gen)]
    shapes[5], shapes[40] = (0, 3), (4, 0)
    case = AdamWInt8Case(shapes, torch.float16, seed=14)
    assert case.check() == launches_for("adamw_int8", moment_blocks(shapes)) >= 3


def test_adamw_int8_more_blocks_than_one_launch_holds():
    # Rows of 3: 330 chunks of moment blocks in 63K elements; the first tensor spans
    # two launches and the next joins it in the second.
    shapes = [(330 * INT8_CHUNK + 5, 3), (7, 600)]
    case = AdamWInt8Case(shapes, torch.bfloat16, seed=15)
    assert case.check() == launches_for("adamw_int8", moment_blocks(shapes)) == 2


def test_adamw_int8_non_finite_blocks():
    """A NaN in a block makes its scales NaN and its codes 0, an infinite gradient
    its scales inf; the bits of both (NaN's payload included) as the CPU kernel's."""
    case = AdamWInt8Case([(3, 600), 700], torch.float32, seed=16)
    g = case.lists[1]
    g[0][1, 5], g[0][2, 599], g[1][300] = math.nan, math.inf, -math.inf
    case.check()
    scales = case.lists[3]
    assert math.isnan(scales[0][1, 0].item()) and scales[1][0, 1].item() == math.inf


@pytest.mark.parametrize("which", ["lr", "step", "both"])
def test_adamw_int8_device_scalars(which):
    values = AdamWInt8Case(INT8_SHAPES, torch.bfloat16, seed=17)
    pointers = AdamWInt8Case(INT8_SHAPES, torch.bfloat16, seed=17)
    values.run_emulated(**BY_VALUE)
    kw = by_pointer(which)
    pointers.run_emulated(lr=kw["lr"], step=kw["step"],
                          pointers={name: kw[f"{name}_ptr"] for name in ("lr", "step")
                                    if f"{name}_ptr" in kw})
    for name, got, want in zip(INT8_LISTS, pointers.written(), values.written()):
        assert_equal(name, got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adamw_int8_grad_scaler_on_the_device(dtype):
    """GradScaler's scale read by the kernel gives the unscaled bits (the value beside
    the pointer is junk, as the ops layer passes); its found_inf leaves everything
    untouched."""
    def case():
        return AdamWInt8Case(INT8_SHAPES, dtype, seed=18)

    want, got, skipped = case(), case(), case()
    want.run_emulated()
    scale = torch.tensor(1024.0)
    got.run_emulated(grads=[g * 1024 for g in got.lists[1]], grad_scale=0.0,
                     pointers={"grad_scale": scale.data_ptr()})
    before = [[t.clone() for t in ts] for ts in skipped.written()]
    found = torch.tensor(1.0)
    skipped.run_emulated(pointers={"found_inf": found.data_ptr()})
    for name, a, b, c, d in zip(INT8_LISTS, got.written(), want.written(), skipped.written(),
                                before):
        assert_equal(name, a, b)
        assert_equal(name, c, d)


# -------------------------------------------------------------- sign_sgd_

class SignSgdCase:
    def __init__(self, numels, dtype, *, seed=0, misaligned=()):
        self.dtype = dtype
        self.p, self.g = placed_lists(sign_sgd_data(numels, dtype, seed), "pg", misaligned)

    def run_emulated(self, lr=LR, lr_ptr=0):
        return _C.sign_sgd_cuda_emulated(kernel_batch(_C, self.p, self.g),
                                         _C.SignSgdHyper(lr=lr, weight_decay=WD, scale=0.5,
                                                         grad_scale=1.0, found_inf=0.0),
                                         _C.DeviceScalars(lr=lr_ptr))

    def check(self):
        want = [t.clone() for t in self.p]
        _C.sign_sgd_cpu(kernel_batch(_C, want, self.g),
                        _C.SignSgdHyper(lr=LR, weight_decay=WD, scale=0.5, grad_scale=1.0,
                                        found_inf=0.0),
                        torch.get_num_threads())
        launches = self.run_emulated()
        assert_equal("params", self.p, want)
        return launches


@pytest.mark.parametrize("misaligned", [(), ("p",), ("g",), ("p", "g")],
                         ids=["aligned", "p-misaligned", "g-misaligned", "misaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sign_sgd_sizes(dtype, misaligned):
    assert SignSgdCase(SIZES, dtype, misaligned=misaligned).check() == 1


def test_sign_sgd_more_tensors_than_one_launch_holds():
    gen = torch.Generator().manual_seed(4)
    numels = [int(n) for n in torch.randint(1, 2 * TILE, (150,), generator=gen)]
    launches = SignSgdCase(numels, torch.float32, seed=4).check()
    assert launches == launches_for("sign_sgd", numels) >= 3


def test_sign_sgd_more_blocks_than_one_launch_holds():
    numels = [700 * CHUNK + 11, 3]
    launches = SignSgdCase(numels, torch.bfloat16, seed=5).check()
    assert launches == launches_for("sign_sgd", numels) == 3


def test_sign_sgd_device_lr():
    values = SignSgdCase([CHUNK + 5, 77], torch.float16, seed=6)
    pointers = SignSgdCase([CHUNK + 5, 77], torch.float16, seed=6)
    values.run_emulated(lr=BY_VALUE["lr"])
    pointers.run_emulated(lr=0.0, lr_ptr=LR32.data_ptr())
    assert_equal("params", pointers.p, values.p)


# ----------------------------------------------------------- frugal_step_

class FrugalCase:
    def __init__(self, kind, shapes, dtype, index_dtype, *, mode="sign", seed=0,
                 misaligned=()):
        self.kind, self.dtype, self.index_dtype, self.mode = kind, dtype, index_dtype, mode
        data = frugal_data(kind, shapes, dtype, index_dtype, seed)
        self.p, self.g, self.m, self.v, self.idx = placed_lists(data, "pgmvi", misaligned)

    def args(self, p, m, v, lr=LR, step=STEP):
        """The tensors, subsets and hyper-parameters, with p, m, v as given."""
        return [kernel_batch(_C, p, self.g, m, v), subset_batch(_C, p, self.idx, self.kind),
                _C.FrugalHyper(lr=lr, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD,
                               step=step, state_free=STATE_FREE_CODES[self.mode],
                               state_free_scale=0.5, grad_scale=1.0, found_inf=0.0)]

    def run_cpu(self):
        p, m, v = ([t.clone() for t in ts] for ts in (self.p, self.m, self.v))
        _C.frugal_step_cpu(*self.args(p, m, v), torch.get_num_threads())
        return p, m, v

    def run_emulated(self, lr=LR, step=STEP, lr_ptr=0, step_ptr=0):
        return _C.frugal_step_cuda_emulated(*self.args(self.p, self.m, self.v, lr, step),
                                            _C.DeviceScalars(lr=lr_ptr, step=step_ptr))

    def check(self):
        want = self.run_cpu()
        launches = self.run_emulated()
        for name, got, w in zip(("params", "exp_avgs", "exp_avg_sqs"), (self.p, self.m, self.v),
                                want):
            assert_equal(name, got, w)
        return launches


@pytest.mark.parametrize("misaligned", [(), ("p", "g")], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(FRUGAL_SHAPES))
def test_frugal_step(kind, dtype, index_dtype, misaligned):
    for seed, mode in enumerate(STATE_FREE_RULES):
        case = FrugalCase(kind, FRUGAL_SHAPES[kind], dtype, index_dtype, mode=mode, seed=seed,
                          misaligned=misaligned)
        assert case.check() == 1


@pytest.mark.parametrize("which", ["p", "g"])
def test_frugal_step_one_misaligned_list_takes_the_scalar_path(which):
    FrugalCase("rows", FRUGAL_SHAPES["rows"], torch.float16, torch.int32,
               misaligned=(which,)).check()


def test_frugal_step_more_tensors_than_one_launch_holds():
    shapes = [((int(r), int(c)), 0.3) for r, c in
              torch.randint(1, 120, (60, 2), generator=torch.Generator().manual_seed(7))]
    case = FrugalCase("rows", shapes, torch.bfloat16, torch.int64, seed=7)
    numels = [t.numel() for t in case.p]
    assert case.check() == launches_for("frugal_step", numels) >= 3


def test_frugal_step_more_blocks_than_one_launch_holds():
    # A long flat index list, where each block's searches start far from the
    # list's beginning; the tensor spans two launches, the next joins it.
    shapes = [((330 * CHUNK + 7,), 0.2), ((3000,), 0.5)]
    case = FrugalCase("flat", shapes, torch.bfloat16, torch.int32, seed=8)
    numels = [t.numel() for t in case.p]
    assert case.check() == launches_for("frugal_step", numels) == 2


@pytest.mark.parametrize("which", ["lr", "step", "both"])
def test_frugal_step_device_scalars(which):
    shapes = FRUGAL_SHAPES["columns"]
    values = FrugalCase("columns", shapes, torch.float32, torch.int64, seed=9)
    pointers = FrugalCase("columns", shapes, torch.float32, torch.int64, seed=9)
    values.run_emulated(**BY_VALUE)
    pointers.run_emulated(**by_pointer(which))
    for name in ("p", "m", "v"):
        assert_equal(name, getattr(pointers, name), getattr(values, name))


# ------------------------------------------------------ frugal_step_int8_

class FrugalInt8Case:
    """As AdamWInt8Case, with a subset: lists by initial p, g, m, s, v, w, i."""

    def __init__(self, kind, shapes, dtype, index_dtype, *, mode="sign", seed=0,
                 misaligned=()):
        self.kind, self.mode = kind, mode
        data = frugal_int8_data(kind, shapes, dtype, index_dtype, seed)
        self.lists = placed_lists(data, "pgmsvwi", misaligned)

    def call(self, lists, grads=None, lr=LR, step=STEP, grad_scale=1.0):
        """The binding's arguments but the DeviceScalars, with the lists as given."""
        t = frugal_step_int8.Tensors(lists[0], self.lists[1] if grads is None else grads,
                                     *lists[2:6], self.lists[6], self.kind)
        return (kernel_batch(_C, t.params, t.grads), subset_batch(_C, t.params, t.indices, t.kind),
                adamw_int8.moments8_batch(_C, t),
                _C.FrugalHyper(lr=lr, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD,
                               step=step, state_free=STATE_FREE_CODES[self.mode],
                               state_free_scale=0.5, grad_scale=grad_scale, found_inf=0.0))

    def written(self):
        return [self.lists[i] for i in (0, 2, 3, 4, 5)]

    def run_cpu(self):
        lists = [[t.clone() for t in ts] for ts in self.lists]
        _C.frugal_step_int8_cpu(*self.call(lists), torch.get_num_threads())
        return [lists[i] for i in (0, 2, 3, 4, 5)]

    def run_emulated(self, grads=None, pointers=None, **hyper):
        """``pointers``: the DeviceScalars' host addresses, by name."""
        return _C.frugal_step_int8_cuda_emulated(*self.call(self.lists, grads, **hyper),
                                                 _C.DeviceScalars(**(pointers or {})))

    def launches(self):
        """What the planners must reach: frugal_step_'s launches over the params, then
        the members' over the compact states' moment blocks."""
        numels = [t.numel() for t in self.lists[0]]
        return (launches_for("frugal_step", numels) +
                launches_for("frugal_step_int8", moment_blocks([t.shape for t in self.lists[2]])))

    def check(self):
        before = [[t.clone() for t in ts] for ts in self.written()]
        want = self.run_cpu()
        launches = self.run_emulated()
        for name, got, w in zip(INT8_LISTS, self.written(), want):
            assert_same_bits(name, got, w)
        for name, got, b in zip(INT8_LISTS, self.written(), before):
            moved = sum(not torch.equal(x, y) for x, y in zip(got, b) if x.numel())
            assert moved > 0 or (name != "params" and not any(x.numel() for x in got)), \
                f"no {name} changed"
        assert launches == self.launches()
        return launches


@pytest.mark.parametrize("misaligned", [(), ("p", "g"), ("m", "v")],
                         ids=["aligned", "pg-misaligned", "codes-misaligned"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(FRUGAL_INT8_SHAPES))
def test_frugal_step_int8(kind, dtype, index_dtype, misaligned):
    for seed, mode in enumerate(STATE_FREE_RULES):
        case = FrugalInt8Case(kind, FRUGAL_INT8_SHAPES[kind], dtype, index_dtype, mode=mode,
                              seed=seed, misaligned=misaligned)
        assert case.check() == 2


@pytest.mark.parametrize("which", ["p", "g", "m", "v"])
def test_frugal_step_int8_one_misaligned_list_takes_the_scalar_path(which):
    FrugalInt8Case("rows", FRUGAL_INT8_SHAPES["rows"], torch.float16, torch.int32,
                   misaligned=(which,)).check()


def test_frugal_step_int8_more_tensors_than_one_launch_holds():
    shapes = [((int(r), int(c)), 0.3) for r, c in
              torch.randint(1, 300, (60, 2), generator=torch.Generator().manual_seed(19))]
    for kind in FRUGAL_INT8_SHAPES:
        case = FrugalInt8Case(kind, shapes, torch.bfloat16, torch.int64, seed=19)
        case.check()
        assert launches_for("frugal_step", [t.numel() for t in case.lists[0]]) >= 3
        assert launches_for("frugal_step_int8",
                            moment_blocks([t.shape for t in case.lists[2]])) >= 2


def test_frugal_step_int8_more_blocks_than_one_launch_holds():
    # A full columns subset of rows of 3: 330 chunks of moment blocks, the first
    # tensor spanning two launches of the members, the next joining it.
    shapes = [((330 * INT8_CHUNK + 5, 3), 1.0), ((7, 600), 0.5)]
    assert FrugalInt8Case("columns", shapes, torch.float32, torch.int32, seed=20).check() == 3


@pytest.mark.parametrize("which", ["lr", "step", "both"])
def test_frugal_step_int8_device_scalars(which):
    shapes = FRUGAL_INT8_SHAPES["columns"]
    values = FrugalInt8Case("columns", shapes, torch.bfloat16, torch.int64, seed=21)
    pointers = FrugalInt8Case("columns", shapes, torch.bfloat16, torch.int64, seed=21)
    values.run_emulated(**BY_VALUE)
    kw = by_pointer(which)
    pointers.run_emulated(lr=kw["lr"], step=kw["step"],
                          pointers={name: kw[f"{name}_ptr"] for name in ("lr", "step")
                                    if f"{name}_ptr" in kw})
    for name, got, want in zip(INT8_LISTS, pointers.written(), values.written()):
        assert_equal(name, got, want)


@pytest.mark.parametrize("kind", list(FRUGAL_INT8_SHAPES))
def test_frugal_step_int8_grad_scaler_on_the_device(kind):
    def case():
        return FrugalInt8Case(kind, FRUGAL_INT8_SHAPES[kind], torch.float16, torch.int32,
                              mode="sgd", seed=22)

    want, got, skipped = case(), case(), case()
    want.run_emulated()
    scale = torch.tensor(1024.0)
    got.run_emulated(grads=[g * 1024 for g in got.lists[1]], grad_scale=0.0,
                     pointers={"grad_scale": scale.data_ptr()})
    before = [[t.clone() for t in ts] for ts in skipped.written()]
    found = torch.tensor(1.0)
    skipped.run_emulated(pointers={"found_inf": found.data_ptr()})
    for name, a, b, c, d in zip(INT8_LISTS, got.written(), want.written(), skipped.written(),
                                before):
        assert_equal(name, a, b)
        assert_equal(name, c, d)


# ----------------------------------------------------------- dqt_update_

class DqtCase:
    def __init__(self, kind, shapes, bits, dtype, index_dtype, *, mode="sign", seed=0,
                 misaligned=()):
        self.kind, self.bits, self.mode = kind, bits, mode
        data = dqt_data(kind, shapes, bits, dtype, index_dtype, seed)
        self.q, self.s, self.g, self.m, self.v, self.idx = placed_lists(data, "qsgmvi",
                                                                        misaligned)
        self.seeds = [2**32 - 1 - 977 * i for i in range(len(shapes))]

    def args(self, q, m, v, grads=None, lr=LR, step=STEP, grad_scale=1.0):
        """The batches and the hyper-parameters, with codes and moments as given."""
        t = dqt_update.Tensors(q, self.s, self.g if grads is None else grads, m, v, self.idx,
                               self.kind, self.seeds)
        return [*dqt_update._kernel_batches(_C, t),
                _C.DqtHyper(lr=lr, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD,
                            step=step, state_free=STATE_FREE_CODES[self.mode],
                            state_free_scale=0.5, grad_scale=grad_scale, found_inf=0.0,
                            bits=self.bits, rng_step=2**32 - 5)]

    def run_cpu(self):
        q, m, v = ([t.clone() for t in ts] for ts in (self.q, self.m, self.v))
        _C.dqt_update_cpu(*self.args(q, m, v), torch.get_num_threads())
        return q, m, v

    def run_emulated(self, grads=None, lr=LR, step=STEP, grad_scale=1.0, pointers=None):
        """``pointers``: the DeviceScalars' host addresses, by name."""
        return _C.dqt_update_cuda_emulated(
            *self.args(self.q, self.m, self.v, grads, lr, step, grad_scale),
            _C.DeviceScalars(**(pointers or {})))

    def check(self):
        before = [t.clone() for t in self.q]
        want = self.run_cpu()
        launches = self.run_emulated()
        for name, got, w in zip(("codes", "exp_avgs", "exp_avg_sqs"), (self.q, self.m, self.v),
                                want):
            assert_equal(f"{name} ({self.bits} bits)", got, w)
        assert any(not torch.equal(a, b) for a, b in zip(self.q, before)), "no code changed"
        return launches


@pytest.mark.parametrize("misaligned", [(), ("g",)], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(DQT_SHAPES))
def test_dqt_update(kind, dtype, index_dtype, misaligned):
    """Every code width, each under one state-free rule, against the CPU kernel: the
    codes (every rounding decision) and the moments bit for bit."""
    for seed, bits in enumerate(QUANT_BITS):
        case = DqtCase(kind, DQT_SHAPES[kind], bits, dtype, index_dtype,
                       mode=STATE_FREE_RULES[seed % 3], seed=seed, misaligned=misaligned)
        assert case.check() == 1


def test_dqt_update_more_tensors_than_one_launch_holds():
    shapes = [((int(r), int(c)), 0.3) for r, c in
              torch.randint(1, 120, (50, 2), generator=torch.Generator().manual_seed(10))]
    case = DqtCase("columns", shapes, 3, torch.bfloat16, torch.int64, seed=10)
    assert case.check() == launches_for("dqt_update", dqt_padded(shapes)) >= 3


def test_dqt_update_more_blocks_than_one_launch_holds():
    # 330 chunks of padded positions (C = 1001 pads to 1008): the first weight spans
    # two launches and the next joins it in the second.
    rows = 330 * DQT_CHUNK // 1008 + 1
    shapes = [((rows, 1001), 0.2), ((30, 70), 0.5)]
    case = DqtCase("flat", shapes, 4, torch.float16, torch.int32, seed=11)
    assert case.check() == launches_for("dqt_update", dqt_padded(shapes)) == 2


def test_dqt_update_tile_and_chunk_bounds():
    """Rows whose padded length puts tile and chunk bounds anywhere in a row, in
    one call, with rows of a state-full subset cut by them."""
    shapes = [((3, DQT_CHUNK - 8), 0.7), ((2, DQT_CHUNK + 3), 0.5), ((9, DQT_TILE + 9), 0.5),
              ((5, 3 * DQT_TILE - 1), 0.4)]
    for bits in (3, 8):
        DqtCase("rows", shapes, bits, torch.float32, torch.int64, seed=bits).check()


@pytest.mark.parametrize("which", ["lr", "step", "both"])
def test_dqt_update_device_scalars(which):
    values = DqtCase("rows", DQT_SHAPES["rows"], 2, torch.float32, torch.int64, seed=12)
    pointers = DqtCase("rows", DQT_SHAPES["rows"], 2, torch.float32, torch.int64, seed=12)
    values.run_emulated(**BY_VALUE)
    kw = by_pointer(which)
    pointers.run_emulated(lr=kw["lr"], step=kw["step"],
                          pointers={name: kw[f"{name}_ptr"] for name in ("lr", "step")
                                    if f"{name}_ptr" in kw})
    for name in ("q", "m", "v"):
        assert_equal(name, getattr(pointers, name), getattr(values, name))


def test_dqt_update_grad_scaler_on_the_device():
    """GradScaler's scale read by the kernel gives the unscaled bits (the value beside
    the pointer is junk, as the ops layer passes); its found_inf leaves everything
    untouched."""
    def case():
        return DqtCase("columns", DQT_SHAPES["columns"], 4, torch.bfloat16, torch.int32,
                       seed=13)

    want, got, skipped = case(), case(), case()
    want.run_emulated()
    scale = torch.tensor(1024.0)
    got.run_emulated(grads=[g * 1024 for g in got.g], grad_scale=0.0,
                     pointers={"grad_scale": scale.data_ptr()})
    before = [[t.clone() for t in ts] for ts in (skipped.q, skipped.m, skipped.v)]
    found = torch.tensor(1.0)
    skipped.run_emulated(pointers={"found_inf": found.data_ptr()})
    for i, name in enumerate(("q", "m", "v")):
        assert_equal(name, getattr(got, name), getattr(want, name))
        assert_equal(name, getattr(skipped, name), before[i])


# -------------------------------------------------------------- grad_norm

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def run_grad_norm(grads, max_norm, capacity=None):
    """The emulated first kernel over ``grads`` (one dtype): (partials, launches)."""
    count = len(grad_norm_partials(grads, max_norm))
    # NaN, so that a partial no block wrote shows.
    partials = torch.full((count if capacity is None else capacity,), math.nan,
                          dtype=torch.float64)
    launches = _C.grad_norm_cuda_emulated([g.data_ptr() for g in grads],
                                          [g.numel() for g in grads], DTYPE_CODE[grads[0].dtype],
                                          max_norm, partials.data_ptr(), partials.numel())
    return partials, launches


def check_partials(grads, max_norm):
    got, launches = run_grad_norm(grads, max_norm)
    want = torch.tensor(grad_norm_partials(grads, max_norm), dtype=torch.float64)
    if max_norm:
        assert torch.equal(got, want)  # a maximum has one order-free answer
    else:
        # Another order of the same double additions.
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0.0)
    return launches


@pytest.mark.parametrize("max_norm", [False, True], ids=["2", "inf"])
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grad_norm_partials(dtype, misaligned, max_norm):
    grads = [placed(g, misaligned=misaligned)
             for g in grad_norm_data(GN_SIZES, dtype, seed=30)]
    assert check_partials(grads, max_norm) == 1


@pytest.mark.parametrize("max_norm", [False, True], ids=["2", "inf"])
def test_grad_norm_more_tensors_and_blocks_than_one_launch_holds(max_norm):
    gen = torch.Generator().manual_seed(31)
    numels = [int(n) for n in torch.randint(1, 3 * 2048, (100,), generator=gen)]
    numels[10] = numels[50] = 0
    # 321 chunks: the first tensor spans two launches, whose partials must land in order.
    numels[70] = 320 * GN_CHUNK + 3
    grads = grad_norm_data(numels, torch.bfloat16, seed=31)
    assert check_partials(grads, max_norm) == launches_for("grad_norm", numels) >= 3


@pytest.mark.parametrize("max_norm", [False, True], ids=["2", "inf"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_grad_norm_non_finite_elements_reach_their_partial(bad, max_norm):
    sizes = [GN_CHUNK + 9, 513]
    for t, position in [(0, 0), (0, GN_CHUNK - 1), (0, GN_CHUNK + 8), (1, 0), (1, 512)]:
        grads = grad_norm_data(sizes, torch.float16, seed=32)
        grads[t][position] = bad
        partials, _ = run_grad_norm(grads, max_norm)
        chunk = t * 2 + position // GN_CHUNK  # tensor 0 has two chunks
        for i, x in enumerate(partials.tolist()):
            if i != chunk:
                assert math.isfinite(x), (t, position, i)
            elif math.isnan(bad):
                assert math.isnan(x), (t, position)
            else:
                assert x == math.inf, (t, position)


def test_grad_norm_refuses_a_short_buffer():
    grads = grad_norm_data([GN_CHUNK + 1, 5], torch.float32, seed=33)
    partials, _ = run_grad_norm(grads, False, capacity=4)
    assert math.isfinite(partials[2].item()) and math.isnan(partials[3].item())
    with pytest.raises(ValueError, match="3 partial results for a buffer of 2"):
        run_grad_norm(grads, False, capacity=2)


def finish(partials, max_norm):
    partials = torch.tensor(partials, dtype=torch.float64)
    norm, found = torch.full((), -1.0), torch.full((1,), -1.0)
    _C.grad_norm_finish_cuda_emulated(partials.data_ptr(), partials.numel(), max_norm,
                                      norm.data_ptr(), found.data_ptr())
    return norm.item(), found.item()


def test_grad_norm_finish():
    gen = torch.Generator().manual_seed(34)
    # More partials than the block has threads, some threads with none.
    for count in (0, 1, 255, 256, 257, 1000):
        parts = (torch.rand(count, generator=gen, dtype=torch.float64) * 100).tolist()
        norm, found = finish(parts, False)
        assert norm == pytest.approx(math.sqrt(sum(parts)), rel=2 ** -23) and found == 0.0
        assert finish(parts, True) == (float(torch.tensor(max(parts, default=0.0))), 0.0)
    parts = [1.0] * 600
    for bad in (math.nan, math.inf):
        for where in (0, 299, 599):
            with_bad = parts[:where] + [bad] + parts[where + 1:]
            for max_norm in (False, True):
                norm, found = finish(with_bad, max_norm)
                assert found == 1.0 and (math.isnan(norm) if math.isnan(bad) else norm == bad)
    # The flag says whether an element was NaN or infinite, as the cpu backend's: a norm
    # of finite gradients past fp32's range is inf as float32, its flag 0.
    assert finish([1e77, 1e77], False) == (math.inf, 0.0)
    assert finish([1e30, 4e30], False) == (float(torch.tensor(math.sqrt(5e30))), 0.0)


# ------------------------------------------------- the ops' cuda glue

class _EmulatedCuda:
    """_C with every ``<op>_cuda`` entry point replaced by its emulation (the
    stream dropped), so that the ops' cuda backends run on the host."""

    def __getattr__(self, name):
        if name.endswith("_cuda"):
            emulated = getattr(_C, name + "_emulated")
            return lambda *args: emulated(*args[:-1])
        return getattr(_C, name)


@pytest.fixture
def emulated_cuda(monkeypatch):
    fake = _EmulatedCuda()
    for module in (adamw, adamw_int8, sign_sgd, frugal_step, frugal_step_int8, dqt_update,
                   grad_norm):
        monkeypatch.setattr(module, "extension", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device: types.SimpleNamespace(cuda_stream=0))


def _both(module, tensors, hyper):
    """Run the op's cuda backend (emulated) and its cpu backend on copies of
    ``tensors``; return both results."""
    runs = []
    for backend in (module._cuda, module._cpu):
        t = type(tensors)(*([x.clone() if isinstance(x, torch.Tensor) else x for x in v]
                            if isinstance(v, list) else v for v in tensors))
        backend(t, hyper)
        runs.append(t)
    return runs


def test_the_ops_cuda_backends_build_the_same_call_as_the_cpu_ones(emulated_cuda):
    """ops.<op>._cuda: the hyper-parameter struct, DeviceScalars and batch it
    builds drive the (emulated) kernels to the cpu backend's bits."""
    lr, step = torch.tensor(LR), torch.tensor(STEP)
    scale, found = torch.tensor(4.0), torch.tensor(0.0)  # GradScaler's, as the optimizers pass
    data = adamw_data([CHUNK + 3, 77], torch.bfloat16, seed=20)
    got, want = _both(adamw, adamw.Tensors(*data),
                      adamw.AdamWHyper(lr, BETA1, BETA2, EPS, WD, step, True, scale, found))
    for a, b in zip(got, want):
        assert_equal("adamw_", a, b)
    got, want = _both(adamw_int8, adamw_int8.Tensors(*adamw_int8_data([(3, 300), 77],
                                                                      torch.float16, 24)),
                      adamw.AdamWHyper(lr, BETA1, BETA2, EPS, WD, step, False, scale, found))
    for name, a, b in zip(INT8_LISTS, [got[i] for i in (0, 2, 3, 4, 5)],
                          [want[i] for i in (0, 2, 3, 4, 5)]):
        assert_equal(f"adamw_int8_ {name}", a, b)
    got, want = _both(sign_sgd, sign_sgd.Tensors(*sign_sgd_data([CHUNK + 3], torch.float16, 21)),
                      sign_sgd.SignSgdHyper(lr, WD, 0.5, scale, None))
    assert_equal("sign_sgd_", got.params, want.params)
    for kind, rule in (("rows", "sgd"), ("columns", "sign"), ("flat", "none")):
        data = frugal_data(kind, FRUGAL_SHAPES[kind], torch.float32, torch.int32, seed=22)
        got, want = _both(frugal_step, frugal_step.Tensors(*data, kind),
                          frugal_step.FrugalHyper(lr, BETA1, BETA2, EPS, WD, step, rule, 0.5,
                                                  None, found))
        for a, b in zip(got[:3], want[:3]):
            assert_equal(f"frugal_step_ {kind}", a, b)
    for kind, rule in (("rows", "none"), ("columns", "sign")):
        data = frugal_int8_data(kind, FRUGAL_INT8_SHAPES[kind], torch.bfloat16, torch.int64,
                                seed=25)
        got, want = _both(frugal_step_int8, frugal_step_int8.Tensors(*data, kind),
                          frugal_step.FrugalHyper(lr, BETA1, BETA2, EPS, WD, step, rule, 0.5,
                                                  scale, found))
        for name, i in zip(INT8_LISTS, (0, 2, 3, 4, 5)):
            assert_equal(f"frugal_step_int8_ {kind} {name}", got[i], want[i])
    for kind, rule in (("rows", "sign"), ("columns", "sgd"), ("flat", "none")):
        data = dqt_data(kind, DQT_SHAPES[kind], 3, torch.bfloat16, torch.int64, seed=23)
        got, want = _both(dqt_update, dqt_update.Tensors(*data, kind, list(range(len(data[0])))),
                          dqt_update.DqtHyper(lr=lr, beta1=BETA1, beta2=BETA2, eps=EPS,
                                              weight_decay=WD, step=step, state_free=rule,
                                              state_free_scale=0.5, grad_scale=scale,
                                              found_inf=found, bits=3, rng_step=2**31 + 7))
        for name in ("codes", "exp_avgs", "exp_avg_sqs"):
            assert_equal(f"dqt_update_ {kind} {name}", getattr(got, name), getattr(want, name))


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["2", "inf"])
def test_the_grad_norm_cuda_backend_gives_the_cpu_backends_norm(emulated_cuda, norm_type):
    """ops.grad_norm._cuda: every dtype's partials in one buffer at their offsets, then
    the norm and flag, as the cpu backend gives them (another order of double sums)."""
    grads = [g for i, dtype in enumerate(DTYPES)
             for g in grad_norm_data([GN_CHUNK + 3, 0, 77, 2 * GN_CHUNK], dtype, seed=40 + i)]
    for case in (grads, grads[4:8], [grads[1]], []):
        if not case:
            got = (torch.zeros(()), torch.zeros(1))  # the op answers an empty list itself
        else:
            got = grad_norm._cuda(case, norm_type)
        want = grad_norm._cpu(case, norm_type) if case else got
        assert got[0].shape == () and got[1].shape == (1,)
        assert math.isclose(got[0].item(), want[0].item(), rel_tol=2 ** -23)
        assert torch.equal(got[1], want[1])
    grads[10][5] = math.nan
    norm, found = grad_norm._cuda(grads, norm_type)
    assert math.isnan(norm.item()) and found.item() == 1.0


# ------------------------------------------------------------------ build

def test_cuda_kernels_are_built_where_nvcc_is():
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the CUDA kernels are not expected in this build")
    if os.environ.get("FRUGAL_CUDA") == "0":
        pytest.skip("FRUGAL_CUDA=0: the CUDA kernels were switched off")
    info = frugal_kernels.build_info()
    assert info["cuda"], (
        "nvcc is on PATH but frugal_kernels._C was built without the CUDA kernels: rebuild with "
        "`python setup.py build_ext --inplace` (FRUGAL_CUDA=auto or 1, not 0) and check the "
        "CMake output for why CUDA was skipped")
    assert info["nvcc_version"] and info["cuda_archs"], info
