"""DQT on QuantLinear weights: against a for-loop reference, rounding statistics,
training a small LLaMA at every code width, resume, and bad input.

The contract tests (checkpoints, schedulers, closures, GradScaler, groups) run
DQT's entries of the optimizer table (tests/optim_db.py).
"""

import io
import math

import pytest
import torch
from torch import nn

import frugal_kernels as fk
from frugal_kernels import _quant
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM
from frugal_kernels.nn import QuantLinear, QuantWeight

from .helpers import HYPER


def _layers(seed=0):
    torch.manual_seed(seed)
    return [QuantLinear(23, 17, bits=4, scale="row", seed=11),
            QuantLinear(17, 9, bits=3, seed=12),
            QuantLinear(9, 5, bias=False, bits=2, seed=13)]


def _reference_dqt(layers, grads_seq, lr, betas, eps, weight_decay):
    """The DQT-adamw trajectory of the layers' codes, written out per element: AdamW
    on s * q, then stochastic rounding with the uniforms of (layer seed, step, index)."""
    beta1, beta2 = betas
    codes = []
    for layer in layers:
        q = _quant.unpack(layer.codes, layer.bits, layer.in_features).double()
        s = layer.scale.double().reshape(-1, 1)
        m = torch.zeros_like(q)
        v = torch.zeros_like(q)
        top = _quant.qmax(layer.bits)
        for t, grads in enumerate(grads_seq, start=1):
            g = grads[layers.index(layer)].double()
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + eps)
            w = s * q * (1 - lr * weight_decay) - lr * update
            x = w / s
            u = _quant.uniform(layer.seed, t, torch.arange(x.numel())).double().reshape(x.shape)
            q = (x.floor() + (u < x - x.floor()).double()).clamp(-top, top)
        codes.append(_quant.pack(q.to(torch.int32), layer.bits))
    return codes


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_adamw_update_matches_the_for_loop_reference(backend):
    layers = _layers()
    reference_layers = _layers()
    gen = torch.Generator().manual_seed(4)
    grads_seq = [[torch.randn(l.out_features, l.in_features, generator=gen) * 0.01
                  for l in layers] for _ in range(12)]
    opt = fk.DQT([l.weight for l in layers], backend=backend, **HYPER)
    for grads in grads_seq:
        for l, g in zip(layers, grads):
            l.weight.grad = g.clone()
        opt.step()
    expected = _reference_dqt(reference_layers, grads_seq, HYPER["lr"], HYPER["betas"],
                              HYPER["eps"], HYPER["weight_decay"])
    for layer, want in zip(layers, expected):
        got = _quant.unpack(layer.codes, layer.bits, layer.in_features)
        ref = _quant.unpack(want, layer.bits, layer.in_features)
        # fp32 in the op against fp64 here: a rounding decision flips only where
        # the uniform lands within an ulp of the fractional part.
        assert (got != ref).float().mean().item() <= 2e-3
        assert (got - ref).abs().max().item() <= 1


def test_the_expected_weight_is_the_exact_update():
    """Stochastic rounding is unbiased: over many seeds the mean dequantized weight
    after one SignSGD step is the unrounded one, within 5 standard errors, and no
    code leaves the range (weights at the range's ends clamp)."""
    torch.manual_seed(0)
    rows, cols, trials, lr = 8, 16, 400, 0.013
    base = QuantLinear(cols, rows, bias=False, bits=3)
    base.scale.fill_(0.1)
    grad = torch.randn(rows, cols)
    w0 = base.dequantize()
    exact = (w0 - lr * torch.sign(grad)).clamp(-0.3, 0.3)
    inside = (w0 - lr * torch.sign(grad)).abs() < 0.3
    total = torch.zeros(rows, cols)
    total_sq = torch.zeros(rows, cols)
    for trial in range(trials):
        layer = QuantLinear(cols, rows, bias=False, bits=3, seed=trial)
        layer.codes.copy_(base.codes)
        layer.scale.fill_(0.1)
        opt = fk.DQT([layer.weight], lr=lr, update="sign")
        layer.weight.grad = grad.clone()
        opt.step()
        q = _quant.unpack(layer.codes, 3, cols)
        assert int(q.abs().max()) <= 3
        w = layer.dequantize()
        total += w
        total_sq += w * w
    mean = total / trials
    std = (total_sq / trials - mean * mean).clamp(min=0).sqrt()
    bound = 5 * std / math.sqrt(trials) + 1e-6
    assert bool(((mean - exact).abs()[inside] <= bound[inside]).all())
    # At the range's end the codes clamp: the weight stays at the largest code.
    assert torch.allclose(mean[~inside], exact[~inside])


def _llama(bits, seed=0):
    config = LlamaConfig.from_preset("tiny", vocab_size=64, max_seq_len=32)
    model = LlamaForCausalLM(config, seed=seed)
    fk.quantize_(model, bits=bits, scale="row")
    return model


@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
@pytest.mark.parametrize("update", ["adamw", "frugal"])
def test_a_small_llama_learns_at_every_code_width(bits, update):
    model = _llama(bits)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 64, (8, 32), generator=gen)
    opt = fk.DQT(model.parameters(), lr=3e-3, update=update, density=0.25, update_gap=10)
    losses = []
    for _ in range(30):
        loss = model(batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert math.isfinite(losses[-1])
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5, losses


def test_no_float_copy_of_a_quantized_weight_in_the_optimizer():
    """The state of a quantized weight is its moments (compact under FRUGAL), never
    the weight: no state tensor equals its dequantized weight, and with FRUGAL
    columns no state tensor has the weight's size."""
    model = _llama(4)
    opt = fk.DQT(model.parameters(), update="frugal", projection="columns", density=0.25)
    batch = torch.randint(0, 64, (2, 16))
    model(batch, labels=batch).loss.backward()
    opt.step()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            w = module.dequantize()
            for value in opt.state[module.weight].values():
                assert value.numel() < w.numel()
                assert not (value.shape == w.shape and torch.equal(value, w))


def test_state_bytes_follow_the_update():
    sizes = {}
    for update in ("adamw", "frugal", "sign"):
        model = _llama(4)
        opt = fk.DQT(model.parameters(), update=update, projection="columns", density=0.25)
        batch = torch.randint(0, 64, (2, 16))
        model(batch, labels=batch).loss.backward()
        opt.step()
        quantized = sum(opt.state[p]["exp_avg"].numel() * 8 for p in model.parameters()
                        if isinstance(p, QuantWeight) and "exp_avg" in opt.state[p])
        sizes[update] = quantized
    n = sum(p.numel() for p in _llama(4).parameters() if isinstance(p, QuantWeight))
    assert sizes["adamw"] == 8 * n
    assert sizes["sign"] == 0
    assert 0.2 * 8 * n < sizes["frugal"] < 0.3 * 8 * n


def _train(model, opt, batches):
    for batch in batches:
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("update", ["adamw", "frugal"])
def test_resume_through_a_checkpoint_gives_the_same_codes(update):
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 64, (2, 16), generator=gen) for _ in range(9)]
    options = dict(lr=3e-3, update=update, density=0.25, update_gap=4)
    model = _llama(3)
    opt = fk.DQT(model.parameters(), **options)
    _train(model, opt, batches)

    first = _llama(3)
    first_opt = fk.DQT(first.parameters(), **options)
    _train(first, first_opt, batches[:5])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = _llama(3, seed=7)
    resumed.load_state_dict(saved["model"])
    resumed_opt = fk.DQT(resumed.parameters(), **options)
    resumed_opt.load_state_dict(saved["opt"])
    _train(resumed, resumed_opt, batches[5:])
    for (name, a), (_, b) in zip(model.state_dict().items(), resumed.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name


def test_backends_write_the_same_codes():
    results = []
    for backend in ("cpu", "torch"):
        layers = _layers()
        opt = fk.DQT([l.weight for l in layers], update="frugal", projection="rows",
                     density=0.5, backend=backend, **HYPER)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            for l in layers:
                l.weight.grad = torch.randn(l.out_features, l.in_features, generator=gen) * 0.02
            opt.step()
        results.append([l.codes.clone() for l in layers])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make,error,match", [
    (lambda ps: fk.DQT(ps, bits=8), ValueError, "4-bit QuantLinear weight, but DQT was given bits=8"),
    (lambda ps: fk.DQT(ps, bits=5), ValueError, "bits must be one of"),
    (lambda ps: fk.DQT(ps, update="lion"), ValueError, "update must be one of"),
    (lambda ps: fk.DQT(ps, update="frugal", projection="svd"), ValueError,
     "low-rank projection"),
    (lambda ps: fk.DQT(ps, update="frugal", projection="random"), ValueError,
     "low-rank projection"),
    (lambda ps: fk.DQT(ps, lr=-1.0), ValueError, "lr must be finite"),
])
def test_bad_options_are_refused(make, error, match):
    layer = _layers()[0]
    with pytest.raises(error, match=match):
        make([layer.weight, layer.bias])


def test_a_bad_step_changes_nothing():
    layers = _layers()
    opt = fk.DQT([p for l in layers for p in l.parameters()], **HYPER)
    for l in layers:
        l.weight.grad = torch.randn(l.out_features, l.in_features)
    opt.step()
    before = [l.codes.clone() for l in layers]
    state = {k: dict(v) for k, v in opt.state.items()}
    for l in layers:
        l.weight.grad = torch.randn(l.out_features, l.in_features)
    opt.param_groups[0]["lr"] = float("inf")
    with pytest.raises(ValueError, match="lr must be finite"):
        opt.step()
    opt.param_groups[0]["lr"] = HYPER["lr"]
    opt.param_groups[0]["update"] = "nesterov"
    with pytest.raises(ValueError, match="update must be one of"):
        opt.step()
    for l, b in zip(layers, before):
        assert torch.equal(l.codes, b)
    assert {k: dict(v) for k, v in opt.state.items()}.keys() == state.keys()


def test_float_parameters_take_adamw():
    """Biases (and any float parameter) follow torch.optim.AdamW."""
    layer = _layers()[0]
    bias = layer.bias
    twin = nn.Parameter(bias.detach().clone())
    opt = fk.DQT([layer.weight, bias], update="frugal", **HYPER)
    ref = torch.optim.AdamW([twin], **HYPER)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        g = torch.randn(bias.shape, generator=gen)
        bias.grad, twin.grad = g.clone(), g.clone()
        layer.weight.grad = torch.zeros(layer.out_features, layer.in_features)
        opt.step()
        ref.step()
    torch.testing.assert_close(bias, twin, rtol=1e-6, atol=1e-7)


def _quantized_blocks():
    model = nn.Module()
    torch.manual_seed(0)
    model.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    fk.quantize_(model, skip=())
    return model


def test_other_optimizers_refuse_a_quantized_weight_instead_of_training_nothing():
    """BAdam and FRUGAL over a quantized model used to advise ``.contiguous()``, and
    following the advice trained a float copy the layer never read (the codes never
    changed). Now FRUGAL refuses the weight when it is given, and an optimizer that
    reaches its values raises, naming DQT; the codes are never left stale silently."""
    model = _quantized_blocks()
    # The engine's optimizers refuse the weight when it is given.
    with pytest.raises(TypeError, match="frugal_kernels.DQT"):
        fk.FRUGAL(model.parameters())
    with pytest.raises(TypeError, match="frugal_kernels.DQT"):
        fk.BAdam(model, switch_every=1)
    codes = [layer.codes.clone() for layer in model.layers]
    for make in (lambda: torch.optim.AdamW(model.parameters()),):
        with pytest.raises(NotImplementedError, match="frugal_kernels.DQT"):
            opt = make()
            model.layers[1](model.layers[0](torch.randn(2, 8))).sum().backward()
            opt.step()
        model.zero_grad()
        assert all(torch.equal(c, layer.codes) for c, layer in zip(codes, model.layers))
    # The weights kept out, FRUGAL trains the rest.
    for layer in model.layers:
        layer.weight.requires_grad_(False)
    fk.FRUGAL([p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("scale", ["tensor", "row"])
@pytest.mark.parametrize("scale_init", ["absmean", "absmax"])
def test_a_zero_initialised_linear_trained_by_dqt_lowers_the_loss(scale, scale_init):
    """A zero-initialised Linear (a common init of output projections) used to get the
    1e-8 floor scale: no weight of the layer could ever pass qmax * 1e-8, and DQT trained
    nothing, silently (loss 1.03 against 0.0135 for float AdamW). An all-zero tensor (or
    row) now takes the scale nn.Linear's default init would get, and trains."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(8, 32, generator=gen) / 32 ** 0.5
    x = torch.randn(256, 32, generator=gen)
    y = x @ target.T
    linear = nn.Linear(32, 8, bias=False)
    nn.init.zeros_(linear.weight)
    model = nn.Sequential(linear)
    fk.quantize_(model, bits=4, scale=scale, scale_init=scale_init)
    layer = model[0]
    assert torch.equal(layer.dequantize(), torch.zeros(8, 32))
    expected = (0.5 if scale_init == "absmean" else 1.0) / 32 ** 0.5 / _quant.qmax(4)
    torch.testing.assert_close(layer.scale, torch.full_like(layer.scale, expected))
    opt = fk.DQT(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    # absmean clips the target weights above its range (loss 0.35 of 0.90), absmax does not
    # (0.13); the floor scale kept it at 0.90.
    assert losses[-1] < 0.5 * losses[0], losses[::10]
