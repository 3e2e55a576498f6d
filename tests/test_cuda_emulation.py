"""The CUDA kernels, emulated on the CPU, against the CPU kernels, bit for bit.

``_C.<op>_cuda_emulated`` runs the block bodies of the CUDA kernels
(csrc/cuda/*.cuh) over an emulated grid with the launch planner of the real
launches, so every index, chunking and vector-path decision of the kernels is
checked here without a GPU. Both sides apply the same update rules in the same
order of operations, so params and states must be *equal*, not close.

The sizes below are chosen around the kernels' constants (csrc/cuda/*.cuh);
the tests that must cross a launch limit assert the number of launches the
emulator reports, so that they fail rather than silently stop covering it
when a constant changes.
"""

import shutil

import pytest
import torch

import frugal_kernels
from frugal_kernels._extension import extension
from frugal_kernels.ops._common import DTYPE_CODES
from frugal_kernels.ops.frugal_step import matrix_view, state_shape

_C = extension()
pytestmark = pytest.mark.skipif(_C is None, reason="frugal_kernels._C is not built")

# csrc/cuda: elements per block of adamw_ / sign_sgd_, positions per tile and
# per block of frugal_step_, and the launch limits.
CHUNK = 16384
TILE = 2048
MAX_BLOCKS = 320
MAX_TENSORS = {"adamw": 36, "sign_sgd": 64, "frugal_step": 24}

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LR, BETA1, BETA2, EPS, WD, STEP = 1e-2, 0.9, 0.999, 1e-8, 0.1, 3.0
STATE_FREE = {"sign": 0, "sgd": 1, "none": 2}


def addresses(tensors):
    return [t.data_ptr() for t in tensors]


def placed(values, *, misaligned=False):
    """A copy of ``values`` whose data starts 16-byte aligned, or one element
    past it, so that the kernels' 16-byte vector path is or is not taken."""
    n = values.numel()
    base = torch.empty(n + 16, dtype=values.dtype)
    assert base.data_ptr() % 16 == 0, "torch's CPU allocator should align to 64 bytes"
    offset = 1 if misaligned else 0
    out = base[offset:offset + n].view(values.shape)
    out.copy_(values)
    assert (out.data_ptr() % 16 == 0) != misaligned
    return out


def grads_like(shape, dtype, gen):
    g = torch.randn(shape, generator=gen)
    # Exact zeros: sign(0) = 0 must agree too.
    g[torch.rand(shape, generator=gen) < 0.05] = 0.0
    return g.to(dtype)


def assert_equal(name, got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(a, b):
            bad = (a != b).nonzero()
            raise AssertionError(f"{name}[{i}] (shape {tuple(a.shape)}, {a.dtype}): "
                                 f"{len(bad)} elements differ, first at {bad[0].tolist()}: "
                                 f"emulated {a[tuple(bad[0])].item()!r} vs cpu "
                                 f"{b[tuple(bad[0])].item()!r}")


def launches_for(numels, chunk, max_tensors):
    """The launch count the planner must reach (csrc/cuda/multi_tensor.h)."""
    launches = tensors = blocks = 0
    for n in numels:
        if n == 0:
            continue
        chunks = -(-n // chunk)
        tensors += 1
        for c in range(chunks):
            blocks += 1
            last = c + 1 == chunks
            if blocks == MAX_BLOCKS or (last and tensors == max_tensors):
                launches += 1
                blocks = 0
                tensors = 0 if last else 1
    return launches + (blocks > 0)


# ----------------------------------------------------------------- adamw_

class AdamWCase:
    def __init__(self, numels, dtype, *, seed=0, misaligned=(), maximize=False):
        gen = torch.Generator().manual_seed(seed)
        self.numels, self.dtype, self.maximize = list(numels), dtype, maximize
        lists = {"p": [], "g": [], "m": [], "v": []}
        for n in numels:
            values = {"p": torch.randn(n, generator=gen).to(dtype),
                      "g": grads_like(n, dtype, gen),
                      "m": 0.1 * torch.randn(n, generator=gen),
                      "v": 0.01 * torch.rand(n, generator=gen)}
            for name, value in values.items():
                lists[name].append(placed(value, misaligned=name in misaligned))
        self.p, self.g, self.m, self.v = lists["p"], lists["g"], lists["m"], lists["v"]

    def run_cpu(self):
        p, m, v = ([t.clone() for t in ts] for ts in (self.p, self.m, self.v))
        _C.adamw_cpu(addresses(p), addresses(self.g), addresses(m), addresses(v), self.numels,
                     DTYPE_CODES[self.dtype], LR, BETA1, BETA2, EPS, WD, STEP, self.maximize,
                     torch.get_num_threads())
        return p, m, v

    def run_emulated(self, lr=LR, step=STEP, lr_ptr=0, step_ptr=0):
        return _C.adamw_cuda_emulated(addresses(self.p), addresses(self.g), addresses(self.m),
                                      addresses(self.v), self.numels, DTYPE_CODES[self.dtype], lr,
                                      BETA1, BETA2, EPS, WD, step, self.maximize, lr_ptr, step_ptr)

    def check(self, **kw):
        want = self.run_cpu()
        launches = self.run_emulated(**kw)
        for name, got, w in zip(("params", "exp_avgs", "exp_avg_sqs"), (self.p, self.m, self.v),
                                want):
            assert_equal(name, got, w)
        return launches


SIZES = [1, 7, TILE - 1, TILE, TILE + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 40001]


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
    assert launches == launches_for(numels, CHUNK, MAX_TENSORS["adamw"]) >= 3


def test_adamw_more_blocks_than_one_launch_holds():
    # 382 chunks: the first tensor spans two launches and the next ones join
    # it in the second, where it must still be found in its table slot.
    numels = [350 * CHUNK + 3, 5, 30 * CHUNK]
    launches = AdamWCase(numels, torch.bfloat16, seed=2).check()
    assert launches == launches_for(numels, CHUNK, MAX_TENSORS["adamw"]) == 2


# lr and step as float32, what a device tensor holds.
LR32 = torch.tensor(LR, dtype=torch.float32)
STEP32 = torch.tensor(STEP, dtype=torch.float32)
BY_VALUE = {"lr": float(LR32), "step": float(STEP32)}


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


# -------------------------------------------------------------- sign_sgd_

class SignSgdCase:
    def __init__(self, numels, dtype, *, seed=0, misaligned=()):
        gen = torch.Generator().manual_seed(seed)
        self.numels, self.dtype = list(numels), dtype
        self.p = [placed(torch.randn(n, generator=gen).to(dtype), misaligned="p" in misaligned)
                  for n in numels]
        self.g = [placed(grads_like(n, dtype, gen), misaligned="g" in misaligned) for n in numels]

    def run_emulated(self, lr=LR, lr_ptr=0):
        return _C.sign_sgd_cuda_emulated(addresses(self.p), addresses(self.g), self.numels,
                                         DTYPE_CODES[self.dtype], lr, WD, 0.5, lr_ptr)

    def check(self):
        want = [t.clone() for t in self.p]
        _C.sign_sgd_cpu(addresses(want), addresses(self.g), self.numels, DTYPE_CODES[self.dtype],
                        LR, WD, 0.5, torch.get_num_threads())
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
    assert launches == launches_for(numels, CHUNK, MAX_TENSORS["sign_sgd"]) >= 3


def test_sign_sgd_more_blocks_than_one_launch_holds():
    numels = [700 * CHUNK + 11, 3]
    launches = SignSgdCase(numels, torch.bfloat16, seed=5).check()
    assert launches == launches_for(numels, CHUNK, MAX_TENSORS["sign_sgd"]) == 3


def test_sign_sgd_device_lr():
    values = SignSgdCase([CHUNK + 5, 77], torch.float16, seed=6)
    pointers = SignSgdCase([CHUNK + 5, 77], torch.float16, seed=6)
    values.run_emulated(lr=BY_VALUE["lr"])
    pointers.run_emulated(lr=0.0, lr_ptr=LR32.data_ptr())
    assert_equal("params", pointers.p, values.p)


# ----------------------------------------------------------- frugal_step_

# Shapes per kind, each with a subset size: a fraction of the rows, columns or
# coordinates it picks from, 0 (no state-full coordinate) or 1 (all).
FRUGAL_SHAPES = {
    # C > 1 not dividing TILE, C = TILE, C > TILE, C dividing TILE, a single row
    "rows": [((37, 300), 0.3), ((3, 700), 0.5), ((8, TILE), 0.4), ((5, 5000), 0.4),
             ((40, 512), 0.25), ((1, 7), 1.0), ((20, 5000), 0.3), ((6, 33), 0.0),
             ((9, 250), 1.0)],
    # C < TILE, C > TILE, C = TILE, C = TILE + 1, a single column
    "columns": [((300, 77), 0.3), ((3, 4500), 0.2), ((20, TILE), 0.1), ((7, TILE + 1), 0.5),
                ((50, 513), 0.25), ((40, 1), 1.0), ((10, 100), 0.0), ((13, 40), 1.0),
                ((2, 3, 700), 0.3)],
    # C = 1: sizes around TILE and the block's chunk
    "flat": [((1,), 1.0), ((7,), 0.5), ((TILE - 1,), 0.3), ((TILE,), 0.3), ((TILE + 1,), 0.3),
             ((CHUNK + 1,), 0.25), ((40000,), 0.1), ((3000,), 0.0), ((2500,), 1.0)],
}


def subset(dim, fraction, index_dtype, gen):
    k = round(dim * fraction)
    return torch.randperm(dim, generator=gen)[:k].sort().values.to(index_dtype)


class FrugalCase:
    def __init__(self, kind, shapes, dtype, index_dtype, *, mode="sign", seed=0,
                 misaligned=()):
        gen = torch.Generator().manual_seed(seed)
        self.kind, self.dtype, self.index_dtype, self.mode = kind, dtype, index_dtype, mode
        self.p, self.g, self.m, self.v, self.idx = [], [], [], [], []
        for shape, fraction in shapes:
            p = placed(torch.randn(shape, generator=gen).to(dtype), misaligned="p" in misaligned)
            dim = {"rows": shape[0], "columns": shape[-1]}.get(kind, p.numel())
            idx = subset(dim, fraction, index_dtype, gen)
            sshape = state_shape(p, kind, idx.numel())
            self.p.append(p)
            self.g.append(placed(grads_like(shape, dtype, gen), misaligned="g" in misaligned))
            self.m.append(0.1 * torch.randn(sshape, generator=gen))
            self.v.append(0.01 * torch.rand(sshape, generator=gen))
            self.idx.append(idx)

    def args(self, p, m, v):
        views = [matrix_view(t, self.kind) for t in self.p]
        return [addresses(p), addresses(self.g), addresses(m), addresses(v),
                [t.numel() for t in self.p], addresses(self.idx), [r for _, r, _ in views],
                [c for _, _, c in views], [i.numel() for i in self.idx], views[0][0],
                self.index_dtype == torch.int32, DTYPE_CODES[self.dtype]]

    def run_cpu(self):
        p, m, v = ([t.clone() for t in ts] for ts in (self.p, self.m, self.v))
        _C.frugal_step_cpu(*self.args(p, m, v), LR, BETA1, BETA2, EPS, WD, STEP, 0.5,
                           STATE_FREE[self.mode], torch.get_num_threads())
        return p, m, v

    def run_emulated(self, lr=LR, step=STEP, lr_ptr=0, step_ptr=0):
        return _C.frugal_step_cuda_emulated(*self.args(self.p, self.m, self.v), lr, BETA1, BETA2,
                                            EPS, WD, step, 0.5, STATE_FREE[self.mode], lr_ptr,
                                            step_ptr)

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
    for seed, mode in enumerate(STATE_FREE):
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
    assert case.check() == launches_for(numels, CHUNK, MAX_TENSORS["frugal_step"]) >= 3


def test_frugal_step_more_blocks_than_one_launch_holds():
    # A long flat index list, where each block's searches start far from the
    # list's beginning; the tensor spans two launches, the next joins it.
    shapes = [((330 * CHUNK + 7,), 0.2), ((3000,), 0.5)]
    case = FrugalCase("flat", shapes, torch.bfloat16, torch.int32, seed=8)
    numels = [t.numel() for t in case.p]
    assert case.check() == launches_for(numels, CHUNK, MAX_TENSORS["frugal_step"]) == 2


@pytest.mark.parametrize("which", ["lr", "step", "both"])
def test_frugal_step_device_scalars(which):
    shapes = FRUGAL_SHAPES["columns"]
    values = FrugalCase("columns", shapes, torch.float32, torch.int64, seed=9)
    pointers = FrugalCase("columns", shapes, torch.float32, torch.int64, seed=9)
    values.run_emulated(**BY_VALUE)
    pointers.run_emulated(**by_pointer(which))
    for name in ("p", "m", "v"):
        assert_equal(name, getattr(pointers, name), getattr(values, name))


# ------------------------------------------------------------------ build

def test_cuda_kernels_are_built_where_nvcc_is():
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the CUDA kernels are not expected in this build")
    info = frugal_kernels.build_info()
    assert info["cuda"], (
        "nvcc is on PATH but frugal_kernels._C was built without the CUDA kernels: rebuild with "
        "`python setup.py build_ext --inplace` (FRUGAL_CUDA=auto or 1, not 0) and check the "
        "CMake output for why CUDA was skipped")
    assert info["nvcc_version"] and info["cuda_archs"], info
