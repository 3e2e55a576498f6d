"""The cuda backend on a GPU against the cpu backend, bit for bit.

Both backends apply the same update rules (csrc/include/frugal) in the same
order of operations with IEEE rounding (nvcc --fmad=false), so params and
states must be equal after the same call on the same data. Skipped without a
GPU; run on a GPU machine with ``pytest -m gpu``.
"""

import math

import pytest
import torch

from frugal_kernels import ops
from frugal_kernels._layout import STATE_FREE_RULES
from frugal_kernels._quant import QUANT_BITS
from frugal_kernels.ops import _dispatch

from .cases import (BETA1, BETA2, CHUNK, DQT_CHUNK, DQT_SHAPES, DTYPES, EPS, FRUGAL_SHAPES,
                    FRUGAL_INT8_SHAPES, GN_CHUNK, GN_SIZES, INT8_CHUNK, INT8_SHAPES, LR, SIZES,
                    STEP, TILE, WD, adamw_data, adamw_int8_data, assert_equal, dqt_data,
                    frugal_data, frugal_int8_data, grad_norm_data, placed, sign_sgd_data)

pytestmark = pytest.mark.gpu


def hyper(**overrides):
    return {"lr": LR, "beta1": BETA1, "beta2": BETA2, "eps": EPS, "weight_decay": WD,
            "step": STEP, **overrides}


@pytest.fixture(autouse=True)
def cuda_backend():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: torch.cuda.is_available() is False")
    reason = _dispatch.unavailable_reason("cuda", "cuda")
    assert reason is None, f"a GPU is here but the cuda backend cannot run: {reason}"


def on_gpu(tensors, misaligned=False):
    return [placed(t, misaligned=misaligned, device="cuda") for t in tensors]


def device_scalars():
    """lr and step as 0-dim float32 tensors on the GPU, as capturable optimizers keep them."""
    return (torch.tensor(LR, dtype=torch.float32, device="cuda"),
            torch.tensor(STEP, dtype=torch.float32, device="cuda"))


class no_host_sync:
    """Makes any synchronising CUDA call inside the block raise."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


# ----------------------------------------------------------------- adamw_

def check_adamw(numels, dtype, *, seed=0, misaligned=False, maximize=False, steps=1,
                scalars_on_device=False):
    host = adamw_data(numels, dtype, seed)
    dev = [on_gpu(ts, misaligned) for ts in host]
    lr, step = device_scalars() if scalars_on_device else (LR, STEP)
    for i in range(steps):
        ops.adamw_(*host, **hyper(step=STEP + i), maximize=maximize, backend="cpu")
        if scalars_on_device:
            with no_host_sync():
                ops.adamw_(*dev, **hyper(lr=lr, step=step), maximize=maximize, backend="cuda")
            step += 1
        else:
            ops.adamw_(*dev, **hyper(step=STEP + i), maximize=maximize, backend="cuda")
    for name, got, want in zip(("params", "exp_avgs", "exp_avg_sqs"), dev, host):
        assert_equal(name, got, want)


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adamw(dtype, misaligned):
    check_adamw(SIZES, dtype, misaligned=misaligned)


def test_adamw_maximize_over_steps():
    check_adamw([5, CHUNK + 3], torch.float32, maximize=True, steps=4)


def test_adamw_many_tensors_and_blocks():
    numels = [350 * CHUNK + 3] + [int(n) for n in torch.randint(
        1, 3 * TILE, (100,), generator=torch.Generator().manual_seed(1))]
    check_adamw(numels, torch.bfloat16, seed=1)


def test_adamw_device_scalars_without_host_sync():
    check_adamw([CHUNK + 5, 77], torch.bfloat16, seed=2, steps=3, scalars_on_device=True)


# ------------------------------------------------------------ adamw_int8_

INT8_WRITTEN = {"params": 0, "exp_avgs": 2, "exp_avg_scales": 3, "exp_avg_sqs": 4,
                "exp_avg_sq_scales": 5}


def check_adamw_int8(shapes, dtype, *, seed=0, misaligned=False, maximize=False, steps=1,
                     scalars_on_device=False, grad_scale=None):
    """The cuda backend against the cpu backend: params, codes and scales equal.
    ``grad_scale``: a GradScaler's scale, the gradients multiplied by it and the scale
    and found_inf passed as GPU tensors (the cpu backend gets the unscaled gradients)."""
    host = list(adamw_int8_data(shapes, dtype, seed))
    dev = [on_gpu(ts, misaligned) for ts in host]
    amp = {}
    if grad_scale is not None:
        dev[1] = [g * grad_scale for g in dev[1]]
        amp = dict(grad_scale=torch.tensor(grad_scale, device="cuda"),
                   found_inf=torch.zeros((), device="cuda"))
    lr, step = device_scalars() if scalars_on_device else (LR, STEP)
    for i in range(steps):
        ops.adamw_int8_(*host, **hyper(step=STEP + i), maximize=maximize, backend="cpu")
        if scalars_on_device:
            with no_host_sync():
                ops.adamw_int8_(*dev, **hyper(lr=lr, step=step), maximize=maximize,
                                backend="cuda", **amp)
            step += 1
        else:
            ops.adamw_int8_(*dev, **hyper(step=STEP + i), maximize=maximize, backend="cuda",
                            **amp)
    for name, i in INT8_WRITTEN.items():
        assert_equal(name, dev[i], host[i])
    if grad_scale is not None:
        before = [[t.clone() for t in dev[i]] for i in INT8_WRITTEN.values()]
        amp["found_inf"].fill_(1.0)
        ops.adamw_int8_(*dev, **hyper(step=STEP + steps), backend="cuda", **amp)
        for (name, i), b in zip(INT8_WRITTEN.items(), before):
            assert_equal(name, dev[i], b)


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adamw_int8(dtype, misaligned):
    check_adamw_int8(INT8_SHAPES, dtype, misaligned=misaligned)


def test_adamw_int8_maximize_over_steps():
    check_adamw_int8([(4, 300), 5, (3, 1024)], torch.float32, maximize=True, steps=4)


def test_adamw_int8_many_tensors_and_blocks():
    shapes = [(330 * INT8_CHUNK + 5, 3), (2, 2**20 + 3)] + [
        (int(r), int(c)) for r, c in torch.randint(1, 300, (70, 2),
                                                   generator=torch.Generator().manual_seed(14))]
    check_adamw_int8(shapes, torch.bfloat16, seed=14)


def test_adamw_int8_device_scalars_without_host_sync():
    check_adamw_int8(INT8_SHAPES, torch.bfloat16, seed=17, steps=3, scalars_on_device=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_adamw_int8_grad_scaler_on_the_device(dtype):
    check_adamw_int8(INT8_SHAPES, dtype, seed=18, steps=2, scalars_on_device=True,
                     grad_scale=1024.0)


# -------------------------------------------------------------- sign_sgd_

def check_sign_sgd(numels, dtype, *, seed=0, misaligned=False, lr_on_device=False):
    p, g = sign_sgd_data(numels, dtype, seed)
    dp, dg = on_gpu(p, misaligned), on_gpu(g, misaligned)
    ops.sign_sgd_(p, g, lr=LR, weight_decay=WD, scale=0.5, backend="cpu")
    if lr_on_device:
        lr, _ = device_scalars()
        with no_host_sync():
            ops.sign_sgd_(dp, dg, lr=lr, weight_decay=WD, scale=0.5, backend="cuda")
    else:
        ops.sign_sgd_(dp, dg, lr=LR, weight_decay=WD, scale=0.5, backend="cuda")
    assert_equal("params", dp, p)


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sign_sgd(dtype, misaligned):
    check_sign_sgd(SIZES, dtype, misaligned=misaligned)


def test_sign_sgd_many_tensors_and_blocks():
    numels = [700 * CHUNK + 11] + [int(n) for n in torch.randint(
        1, 2 * TILE, (150,), generator=torch.Generator().manual_seed(3))]
    check_sign_sgd(numels, torch.float16, seed=3)


def test_sign_sgd_device_lr_without_host_sync():
    check_sign_sgd([CHUNK + 5, 77], torch.bfloat16, seed=4, lr_on_device=True)


# ----------------------------------------------------------- frugal_step_

def check_frugal_step(kind, shapes, dtype, index_dtype, state_free, *, seed=0, misaligned=False,
                      steps=1, scalars_on_device=False):
    p, g, m, v, idx = frugal_data(kind, shapes, dtype, index_dtype, seed)
    dp, dg = on_gpu(p, misaligned), on_gpu(g, misaligned)
    dm, dv, didx = on_gpu(m), on_gpu(v), on_gpu(idx)
    common = dict(kind=kind, state_free=state_free, state_free_scale=0.5)
    lr, step = device_scalars() if scalars_on_device else (LR, STEP)
    for i in range(steps):
        ops.frugal_step_(p, g, m, v, idx, **common, **hyper(step=STEP + i), backend="cpu")
        if scalars_on_device:
            # check_indices=False: checking the indices reads them on the host.
            with no_host_sync():
                ops.frugal_step_(dp, dg, dm, dv, didx, **common, **hyper(lr=lr, step=step),
                                 backend="cuda", check_indices=False)
            step += 1
        else:
            ops.frugal_step_(dp, dg, dm, dv, didx, **common, **hyper(step=STEP + i),
                             backend="cuda")
    for name, got, want in zip(("params", "exp_avgs", "exp_avg_sqs"), (dp, dm, dv), (p, m, v)):
        assert_equal(name, got, want)


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(FRUGAL_SHAPES))
def test_frugal_step(kind, dtype, index_dtype, misaligned):
    for seed, state_free in enumerate(STATE_FREE_RULES):
        check_frugal_step(kind, FRUGAL_SHAPES[kind], dtype, index_dtype, state_free, seed=seed,
                          misaligned=misaligned)


def test_frugal_step_many_tensors_and_blocks():
    sizes = torch.randint(1, 120, (60, 2), generator=torch.Generator().manual_seed(5))
    check_frugal_step("rows", [((int(r), int(c)), 0.3) for r, c in sizes], torch.bfloat16,
                      torch.int64, "sign", seed=5)
    check_frugal_step("flat", [((330 * CHUNK + 7,), 0.2), ((3000,), 0.5)], torch.bfloat16,
                      torch.int32, "sign", seed=6)


def test_frugal_step_over_steps():
    check_frugal_step("columns", FRUGAL_SHAPES["columns"], torch.float32, torch.int64, "sgd",
                      seed=7, steps=4)


@pytest.mark.parametrize("kind", list(FRUGAL_SHAPES))
def test_frugal_step_device_scalars_without_host_sync(kind):
    check_frugal_step(kind, FRUGAL_SHAPES[kind], torch.bfloat16, torch.int32, "sign", seed=8,
                      steps=3, scalars_on_device=True)


# ------------------------------------------------------ frugal_step_int8_

def check_frugal_step_int8(kind, shapes, dtype, index_dtype, state_free, *, seed=0,
                           misaligned=False, steps=1, scalars_on_device=False):
    """The cuda backend against the cpu backend: params, codes and scales equal."""
    host = list(frugal_int8_data(kind, shapes, dtype, index_dtype, seed))
    dev = [on_gpu(ts, misaligned and i < 2) for i, ts in enumerate(host)]
    common = dict(kind=kind, state_free=state_free, state_free_scale=0.5)
    lr, step = device_scalars() if scalars_on_device else (LR, STEP)
    for i in range(steps):
        ops.frugal_step_int8_(*host, **common, **hyper(step=STEP + i), backend="cpu")
        if scalars_on_device:
            with no_host_sync():
                ops.frugal_step_int8_(*dev, **common, **hyper(lr=lr, step=step),
                                      backend="cuda", check_indices=False)
            step += 1
        else:
            ops.frugal_step_int8_(*dev, **common, **hyper(step=STEP + i), backend="cuda")
    for name, i in INT8_WRITTEN.items():
        assert_equal(name, dev[i], host[i])


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(FRUGAL_INT8_SHAPES))
def test_frugal_step_int8(kind, dtype, index_dtype, misaligned):
    for seed, state_free in enumerate(STATE_FREE_RULES):
        check_frugal_step_int8(kind, FRUGAL_INT8_SHAPES[kind], dtype, index_dtype, state_free,
                               seed=seed, misaligned=misaligned)


def test_frugal_step_int8_many_tensors_and_blocks():
    sizes = torch.randint(1, 300, (60, 2), generator=torch.Generator().manual_seed(19))
    for kind in FRUGAL_INT8_SHAPES:
        check_frugal_step_int8(kind, [((int(r), int(c)), 0.3) for r, c in sizes],
                               torch.bfloat16, torch.int64, "sign", seed=19)
    check_frugal_step_int8("columns", [((330 * INT8_CHUNK + 5, 3), 1.0), ((7, 600), 0.5)],
                           torch.float32, torch.int32, "sgd", seed=20)


def test_frugal_step_int8_over_steps():
    check_frugal_step_int8("rows", FRUGAL_INT8_SHAPES["rows"], torch.float32, torch.int64,
                           "sgd", seed=21, steps=4)


@pytest.mark.parametrize("kind", list(FRUGAL_INT8_SHAPES))
def test_frugal_step_int8_device_scalars_without_host_sync(kind):
    check_frugal_step_int8(kind, FRUGAL_INT8_SHAPES[kind], torch.bfloat16, torch.int32, "sign",
                           seed=22, steps=3, scalars_on_device=True)


# ----------------------------------------------------------- dqt_update_

def check_dqt_update(kind, shapes, bits, dtype, index_dtype, state_free, *, seed=0,
                     misaligned=False, steps=1, scalars_on_device=False):
    q, s, g, m, v, idx = dqt_data(kind, shapes, bits, dtype, index_dtype, seed)
    dq, ds, dm, dv, didx = (on_gpu(ts) for ts in (q, s, m, v, idx))
    dg = on_gpu(g, misaligned)
    common = dict(kind=kind, bits=bits, seeds=[2**32 - 1 - i for i in range(len(q))],
                  state_free=state_free, state_free_scale=0.5)
    lr, step = device_scalars() if scalars_on_device else (LR, STEP)
    for i in range(steps):
        ops.dqt_update_(q, s, g, m, v, idx, **common, **hyper(step=STEP + i), rng_step=i,
                        backend="cpu")
        if scalars_on_device:
            with no_host_sync():
                ops.dqt_update_(dq, ds, dg, dm, dv, didx, **common, **hyper(lr=lr, step=step),
                                rng_step=i, backend="cuda", check_indices=False)
            step += 1
        else:
            ops.dqt_update_(dq, ds, dg, dm, dv, didx, **common, **hyper(step=STEP + i),
                            rng_step=i, backend="cuda")
    for name, got, want in zip(("codes", "exp_avgs", "exp_avg_sqs"), (dq, dm, dv), (q, m, v)):
        assert_equal(f"{name} ({bits} bits)", got, want)


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(DQT_SHAPES))
def test_dqt_update(kind, dtype, index_dtype, misaligned):
    for seed, bits in enumerate(QUANT_BITS):
        check_dqt_update(kind, DQT_SHAPES[kind], bits, dtype, index_dtype,
                         STATE_FREE_RULES[seed % 3], seed=seed, misaligned=misaligned)


def test_dqt_update_many_tensors_and_blocks():
    sizes = torch.randint(1, 120, (50, 2), generator=torch.Generator().manual_seed(10))
    check_dqt_update("columns", [((int(r), int(c)), 0.3) for r, c in sizes], 3, torch.bfloat16,
                     torch.int64, "sign", seed=10)
    rows = 330 * DQT_CHUNK // 1008 + 1
    check_dqt_update("flat", [((rows, 1001), 0.2), ((30, 70), 0.5)], 4, torch.float16,
                     torch.int32, "sign", seed=11)


def test_dqt_update_over_steps():
    check_dqt_update("rows", DQT_SHAPES["rows"], 2, torch.float32, torch.int64, "sgd", seed=12,
                     steps=4)


@pytest.mark.parametrize("kind", list(DQT_SHAPES))
def test_dqt_update_device_scalars_without_host_sync(kind):
    check_dqt_update(kind, DQT_SHAPES[kind], 3, torch.bfloat16, torch.int32, "sign", seed=13,
                     steps=3, scalars_on_device=True)


# -------------------------------------------------------------- grad_norm

def check_grad_norm(grads, norm_type, misaligned=False):
    """The cuda backend's norm and flag against the cpu backend's (another order of the
    same double sums: equal after rounding to float32 but for a rare tie), its bits
    the same on a second run, and no host sync."""
    dev = on_gpu(grads, misaligned)
    with no_host_sync():
        norm, found = ops.grad_norm(dev, norm_type=norm_type, backend="cuda")
        again = ops.grad_norm(dev, norm_type=norm_type, backend="cuda")
    want_norm, want_found = ops.grad_norm(grads, norm_type=norm_type, backend="cpu")
    assert norm.device.type == "cuda" and norm.shape == () and found.shape == (1,)
    assert torch.equal(norm, again[0]) and torch.equal(found, again[1])
    if math.isnan(want_norm.item()):
        assert math.isnan(norm.item())
    else:
        assert math.isclose(norm.item(), want_norm.item(), rel_tol=2 ** -23)
    assert torch.equal(found.cpu(), want_found)


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["2", "inf"])
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grad_norm(dtype, misaligned, norm_type):
    check_grad_norm(grad_norm_data(GN_SIZES, dtype, seed=50), norm_type, misaligned)


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["2", "inf"])
def test_grad_norm_mixed_dtypes_many_tensors_and_blocks(norm_type):
    numels = [5, 0, 320 * GN_CHUNK + 3, *range(1, 3000, 37)]
    grads = [g for i, dtype in enumerate(DTYPES) for g in grad_norm_data(numels, dtype, 51 + i)]
    check_grad_norm(grads, norm_type)


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_grad_norm_non_finite(bad):
    grads = grad_norm_data([GN_CHUNK + 9, 513], torch.bfloat16, seed=52)
    grads[0][GN_CHUNK + 8] = bad
    for norm_type in (2.0, math.inf):
        check_grad_norm(grads, norm_type)


def test_grad_norm_replays_in_a_cuda_graph():
    """The launch tables are kernel parameters and the partials buffer comes from the
    graph's pool: a captured call reads the gradients' values at each replay."""
    grads = on_gpu(grad_norm_data([GN_CHUNK + 5, 77], torch.float32, seed=53))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.grad_norm(grads, backend="cuda")  # warm-up outside the capture, as torch asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm, found = ops.grad_norm(grads, backend="cuda")
    grads[1].mul_(1000.0)
    grads[0][3] = math.inf
    graph.replay()
    want_norm, want_found = ops.grad_norm([g.cpu() for g in grads], backend="cpu")
    assert norm.item() == want_norm.item() == math.inf and found.item() == 1.0
    grads[0][3] = 0.0
    graph.replay()
    want_norm, _ = ops.grad_norm([g.cpu() for g in grads], backend="cpu")
    assert math.isclose(norm.item(), want_norm.item(), rel_tol=2 ** -23) and found.item() == 0.0


def test_auto_picks_cuda_for_every_op_that_has_it():
    for op, backends in ops.CAPABILITIES.items():
        # An op without a GPU kernel (dequantize, lowrank_adamw_step_) falls through to torch.
        want = next(b for b in ("cuda", "triton", "torch") if b in backends)
        assert ops.resolve("auto", torch.device("cuda"), op) == want, op


def test_launches_follow_the_current_stream():
    side = torch.cuda.Stream()
    p, g = sign_sgd_data([3 * CHUNK + 1], torch.float32, seed=9)
    dp, dg = on_gpu(p), on_gpu(g)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # The copy waits behind a long kernel: an update launched on any
        # other stream would run first and be overwritten by the copy.
        torch.cuda._sleep(10_000_000)
        dp[0].copy_(dg[0] * 2)
        ops.sign_sgd_(dp, dg, lr=LR, weight_decay=WD, backend="cuda")
    torch.cuda.current_stream().wait_stream(side)
    p[0].copy_(g[0] * 2)
    ops.sign_sgd_(p, g, lr=LR, weight_decay=WD, backend="cpu")
    assert_equal("params", dp, p)
