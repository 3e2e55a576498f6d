"""nn.QuantLinear and quantize_: the stored format, the autograd, the module APIs."""

import copy
import io

import pytest
import torch
from torch import nn

import frugal_kernels as fk
from frugal_kernels import _quant
from frugal_kernels.nn import QuantLinear, QuantWeight
from frugal_kernels.nn import quant_linear as quant_linear_module

from ..ops.helpers import cpu_backends


def _layer(in_f=37, out_f=11, bits=4, scale="tensor", bias=True, seed=0, dtype=None):
    torch.manual_seed(seed)
    return QuantLinear(in_f, out_f, bias=bias, bits=bits, scale=scale, dtype=dtype)


@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
@pytest.mark.parametrize("scale", ["tensor", "row"])
def test_storage_is_the_packed_codes_and_the_scales(bits, scale):
    layer = _layer(bits=bits, scale=scale)
    assert layer.codes.dtype == torch.uint8
    assert tuple(layer.codes.shape) == (11, _quant.packed_cols(37, bits))
    assert layer.codes.numel() <= 11 * (37 * bits + 7) // 8 + 11  # bits/8 per weight
    assert layer.scale.dtype == torch.float32 and layer.scale.numel() == (1 if scale == "tensor"
                                                                         else 11)
    # The parameter holds the codes and scales, and no float values of its own.
    assert isinstance(layer.weight, QuantWeight) and layer.weight.shape == (11, 37)
    assert _storages(layer.weight) == [layer.codes, layer.scale]
    codes = _quant.unpack(layer.codes, bits, 37)
    assert int(codes.abs().max()) <= _quant.qmax(bits)


def _storages(t):
    """The tensors whose memory ``t`` is: itself, or a QuantWeight's codes and scale (a
    wrapper subclass owns no storage)."""
    if isinstance(t, QuantWeight):
        names, _ = t.__tensor_flatten__()
        return [getattr(t, name) for name in names]
    return [t]


def _no_float_copy_of_the_weight(layer):
    """No float tensor of the module holds as many values as the weight."""
    n = layer.in_features * layer.out_features
    for name, t in list(layer.state_dict().items()) + list(layer.named_parameters()) + \
            list(layer.named_buffers()):
        for s in _storages(t) if isinstance(t, torch.Tensor) else []:
            if s.is_floating_point():
                assert s.untyped_storage().nbytes() < n * s.element_size(), name


@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
def test_no_float_copy_of_the_weight_in_the_module(bits):
    layer = _layer(in_f=40, out_f=30, bits=bits)
    layer(torch.randn(3, 40)).sum().backward()
    _no_float_copy_of_the_weight(layer)


@pytest.mark.parametrize("scale_init", _quant.SCALE_INITS)
def test_initial_scale_from_a_linear(scale_init):
    torch.manual_seed(3)
    linear = nn.Linear(50, 20)
    w = linear.weight.detach()
    for bits in _quant.QUANT_BITS:
        qmax = _quant.qmax(bits)
        for scale in ("tensor", "row"):
            layer = QuantLinear.from_linear(linear, bits=bits, scale=scale,
                                            scale_init=scale_init)
            assert layer.scale_init == scale_init
            if scale == "tensor":
                size = w.abs().mean() if scale_init == "absmean" else w.abs().max()
            else:
                size = w.abs().mean(dim=1) if scale_init == "absmean" else \
                    w.abs().max(dim=1).values
            s = size.reshape(-1) / qmax
            assert torch.allclose(layer.scale, s)
            q = torch.round(w / s.reshape(-1, 1)).clamp(-qmax, qmax)
            assert torch.equal(_quant.unpack(layer.codes, bits, 50), q.to(torch.int32))
            assert torch.equal(layer.bias, linear.bias)


@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
def test_absmax_clips_nothing_and_absmean_clips(bits):
    """absmax: every weight within half a step of its code's value, the largest on the
    end of the range; absmean clips the weights above mean|W| (many at every width)."""
    torch.manual_seed(4)
    linear = nn.Linear(64, 32)
    w = linear.weight.detach()
    for scale in ("tensor", "row"):
        absmax = QuantLinear.from_linear(linear, bits=bits, scale=scale, scale_init="absmax")
        s = absmax.scale.reshape(-1, 1)
        assert bool(((absmax.dequantize() - w).abs() <= s / 2 * (1 + 1e-6)).all())
        assert int(_quant.unpack(absmax.codes, bits, 64).abs().max()) == _quant.qmax(bits)
        absmean = QuantLinear.from_linear(linear, bits=bits, scale=scale)
        s = absmean.scale.reshape(-1, 1)
        clipped = (absmean.dequantize() - w).abs() > s / 2 * (1 + 1e-6)
        assert clipped.float().mean() > 0.2


def _dense_twin(layer, x):
    """nn.functional.linear on the layer's dequantized weight and a copy of its bias and
    of ``x``: the output, and the leaves (input, weight, bias) its gradients reach."""
    w = layer.dequantize().requires_grad_(True)
    b = layer.bias.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    return nn.functional.linear(x2, w, b), (x2, w, b)


@pytest.mark.parametrize("block_values", [1 << 20, 64, 1])
@pytest.mark.parametrize("bits,scale", [(4, "tensor"), (3, "row"), (2, "row"), (8, "tensor")])
def test_forward_and_backward_equal_a_linear_on_the_dequantized_weight(monkeypatch, block_values,
                                                                       bits, scale):
    """Blocks of rows (down to one row at a time) give the dense layer's results."""
    monkeypatch.setattr(quant_linear_module, "_BLOCK_VALUES", block_values)
    layer = _layer(bits=bits, scale=scale)
    x = torch.randn(2, 5, 37, requires_grad=True)
    y = layer(x)
    expected, (x2, w, b) = _dense_twin(layer, x)
    torch.testing.assert_close(y, expected)
    grad = torch.randn_like(y)
    y.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(layer.weight.grad, w.grad)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(layer.bias.grad, b.grad)
    assert layer.weight.grad.is_contiguous()


@pytest.mark.parametrize("backend", cpu_backends("frugal::quant_matmul"))
@pytest.mark.parametrize("bits,scale", [(4, "tensor"), (3, "row"), (2, "row"), (8, "tensor")])
def test_the_fused_path_equals_a_linear_on_the_dequantized_weight(monkeypatch, backend, bits,
                                                                  scale):
    """The GPU path (forward and input gradient through ops.quant_matmul, never the
    blocks), forced onto CPU tensors: triton under the interpreter, or the torch backend."""
    calls, original = [], fk.ops.quant_matmul

    def quant_matmul(*args, **kwargs):
        calls.append(kwargs.get("transpose_weight", True))
        return original(*args, **kwargs)

    def no_blocks(*args, **kwargs):
        raise AssertionError("the blocked path ran")

    monkeypatch.setattr(quant_linear_module, "_fused_backend", lambda device: backend)
    monkeypatch.setattr(quant_linear_module.ops, "quant_matmul", quant_matmul)
    monkeypatch.setattr(quant_linear_module, "_blocks", no_blocks)
    layer = _layer(bits=bits, scale=scale)
    x = torch.randn(2, 5, 37, requires_grad=True)
    y = layer(x)
    expected, (x2, w, b) = _dense_twin(layer, x)
    torch.testing.assert_close(y, expected)
    y.sum().backward()  # an expanded gradient of stride 0 goes into the op as it is
    expected.sum().backward()
    assert calls == [True, False]
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(layer.weight.grad, w.grad)
    torch.testing.assert_close(layer.bias.grad, b.grad)


def test_the_blocked_path_runs_on_the_cpu():
    assert quant_linear_module._fused_backend(torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_a_gpu_the_fused_path_equals_the_cpu_layer(dtype):
    """On CUDA (with triton) the layer runs quant_matmul; its outputs and gradients match
    the CPU layer's blocked path (fp32 sums in another order; bf16 to its rounding)."""
    layer = _layer(in_f=300, out_f=130, bits=3, scale="row", dtype=dtype)
    gpu = copy.deepcopy(layer).cuda()
    assert quant_linear_module._fused_backend(torch.device("cuda")) == "triton"
    x = torch.randn(7, 300, dtype=dtype, requires_grad=True)
    xg = x.detach().cuda().requires_grad_(True)
    g = torch.randn(7, 130, dtype=dtype)
    layer(x).backward(g)
    y = gpu(xg)
    y.backward(g.cuda())
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.cpu(), layer(x).detach(), **tol)
    torch.testing.assert_close(xg.grad.cpu(), x.grad, **tol)
    torch.testing.assert_close(gpu.weight.grad.cpu(), layer.weight.grad, **tol)


def test_bf16_gradient_and_input():
    layer = _layer(dtype=torch.bfloat16)
    x = torch.randn(4, 37, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.bfloat16
    assert _storages(layer.weight) == [layer.codes, layer.scale]
    expected = x.float().t().mm(torch.ones(4, 11)).t()
    torch.testing.assert_close(layer.weight.grad.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("block_values", [1 << 20, 80])
def test_bf16_gradient_of_fp32_inputs_is_the_rounded_fp32_gradient(monkeypatch, block_values):
    """Cast a block of rows at a time (80 values: two rows of 37) or at once: the same bits."""
    monkeypatch.setattr(quant_linear_module, "_BLOCK_VALUES", block_values)
    layer = _layer(dtype=torch.bfloat16)
    x = torch.randn(6, 37)
    g = torch.randn(6, 11)
    layer(x).backward(g)
    assert torch.equal(layer.weight.grad, g.t().mm(x).to(torch.bfloat16))


def test_gradients_accumulate_over_backward_passes():
    layer = _layer()
    x1, x2 = torch.randn(3, 37), torch.randn(3, 37)
    layer(x1).sum().backward()
    first = layer.weight.grad.clone()
    layer(x2).sum().backward()
    layer.zero_grad()
    layer(x2).sum().backward()
    second = layer.weight.grad.clone()
    layer.zero_grad()
    layer(x1).sum().backward()
    layer(x2).sum().backward()
    torch.testing.assert_close(layer.weight.grad, first + second)


@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
def test_state_dict_round_trip_is_bit_exact(bits):
    layer = _layer(bits=bits, scale="row", seed=1)
    layer.seed = 77
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert set(sd) == {"codes", "scale", "bias", "_extra_state"}
    other = _layer(bits=bits, scale="row", seed=2)
    other.load_state_dict(sd)
    for name in ("codes", "scale", "bias"):
        assert torch.equal(getattr(other, name), getattr(layer, name)), name
    assert other.seed == 77


def test_loading_a_checkpoint_of_other_bits_or_a_float_weight_fails():
    layer = _layer(bits=4)
    with pytest.raises(RuntimeError, match="size mismatch|bits=3"):
        layer.load_state_dict(_layer(bits=3).state_dict())
    with pytest.raises(RuntimeError, match="from_linear"):
        layer.load_state_dict(nn.Linear(37, 11).state_dict(), strict=False)
    sd = layer.state_dict()
    sd["codes"] = sd["codes"].to(torch.int16)
    with pytest.raises(RuntimeError, match="torch.uint8"):
        layer.load_state_dict(sd)


def test_to_keeps_the_placeholder_small_and_the_scales_fp32():
    layer = _layer(scale="row")
    layer(torch.randn(2, 37)).sum().backward()
    weight = layer.weight
    layer.to(torch.bfloat16)
    assert layer.weight is weight  # an optimizer built before keeps its parameter
    assert weight.dtype == torch.bfloat16 and _storages(weight) == [layer.codes, layer.scale]
    assert weight.grad.dtype == torch.bfloat16
    assert layer.scale.dtype == torch.float32 and layer.codes.dtype == torch.uint8
    assert layer.bias.dtype == torch.bfloat16
    assert list(dict(layer.named_parameters())) == ["weight", "bias"]


def test_deepcopy_is_independent_and_small():
    layer = _layer()
    twin = copy.deepcopy(layer)
    assert _storages(twin.weight) == [twin.codes, twin.scale]
    assert torch.equal(twin.codes, layer.codes) and twin.codes.data_ptr() != layer.codes.data_ptr()
    x = torch.randn(3, 37)
    torch.testing.assert_close(twin(x), layer(x))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(bits=5), ValueError, "bits must be one of"),
    (dict(bits=1), ValueError, "bits must be one of"),
    (dict(scale="column"), ValueError, "scale must be 'tensor' or 'row'"),
    (dict(dtype=torch.float64), TypeError, "dtype must be"),
    (dict(in_features=-1), ValueError, "in_features must be an int"),
    (dict(in_features=0), ValueError, "in_features must be an int >= 1"),
    (dict(out_features=0), ValueError, "out_features must be an int >= 1"),
    (dict(scale_init="absmedian"), ValueError, "scale_init must be one of"),
])
def test_bad_arguments(kwargs, error, match):
    args = {"in_features": 4, "out_features": 3, **kwargs}
    with pytest.raises(error, match=match):
        QuantLinear(**args)


def test_bad_inputs():
    layer = _layer()
    with pytest.raises(ValueError, match="in_features=37"):
        layer(torch.randn(3, 36))
    with pytest.raises(ValueError, match="quantize_from"):
        layer.quantize_from(torch.randn(3, 3))
    with pytest.raises(TypeError, match="nn.Linear"):
        QuantLinear.from_linear(nn.Conv1d(3, 3, 1))


# ---------------------------------------------------------------- quantize_


def _tiny_lm():
    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Embedding(20, 16)
    model.layers = nn.ModuleList(nn.ModuleDict({"q": nn.Linear(16, 16), "up": nn.Linear(16, 32),
                                                "down": nn.Linear(32, 16, bias=False)})
                                 for _ in range(2))
    model.lm_head = nn.Linear(16, 20, bias=False)
    return model


def test_quantize_swaps_every_linear_but_the_head():
    model = _tiny_lm()
    before = {n: m.weight.detach().clone() for n, m in model.named_modules()
              if isinstance(m, nn.Linear)}
    replaced = fk.quantize_(model, bits=3)
    assert replaced == [n for n in before if n != "lm_head"]
    assert type(model.lm_head) is nn.Linear
    seeds = set()
    for name in replaced:
        layer = model.get_submodule(name)
        assert isinstance(layer, QuantLinear) and layer.bits == 3
        seeds.add(layer.seed)
        reference = QuantLinear.from_linear(nn.Linear(*before[name].shape[::-1]), bits=3)
        reference.quantize_from(before[name])
        assert torch.equal(layer.codes, reference.codes)
    assert len(seeds) == len(replaced)  # every layer draws its own random numbers


def test_quantize_skip_takes_names_and_patterns():
    model = _tiny_lm()
    replaced = fk.quantize_(model, skip=["lm_head", r"layers\.1\..*", "down"])
    assert replaced == ["layers.0.q", "layers.0.up"]


def test_quantize_refuses_tied_weights_and_changes_nothing():
    model = _tiny_lm()
    model.lm_head.weight = model.layers[0]["q"].weight  # tied (shapes happen to agree)
    model.lm_head = nn.Linear(16, 16, bias=False)
    model.lm_head.weight = model.layers[0]["q"].weight
    with pytest.raises(ValueError, match="tied weights"):
        fk.quantize_(model, skip=())
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    with pytest.raises(ValueError, match="bits must be one of"):
        fk.quantize_(model, bits=6)
    with pytest.raises(ValueError, match="invalid pattern"):
        fk.quantize_(model, skip="(")
    with pytest.raises(ValueError, match="scale_init must be one of"):
        fk.quantize_(model, skip=(), scale_init="max")
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_quantize_passes_the_scale_init_on():
    model = _tiny_lm()
    before = model.layers[0]["up"].weight.detach().clone()
    fk.quantize_(model, bits=4, scale="row", scale_init="absmax")
    layer = model.layers[0]["up"]
    assert layer.scale_init == "absmax"
    torch.testing.assert_close(layer.scale, before.abs().max(dim=1).values / _quant.qmax(4))


# ------------------------------------------- the weight as a tensor subclass (issue 25)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_to_a_half_dtype_changes_the_bias_and_gradient_only(dtype):
    """The scales stay fp32 bit for bit: rounded through 16 bits every weight moved by
    about 0.3%, and under fp16 a small scale became 0 (a dead layer)."""
    layer = _layer(scale="row")
    with torch.no_grad():
        layer.scale.mul_(1e-6)  # under fp16's smallest normal number (6e-5)
    scale, codes, weight = layer.scale.clone(), layer.codes.clone(), layer.dequantize()
    layer.to(dtype)
    assert torch.equal(layer.scale, scale) and layer.scale.dtype == torch.float32
    assert torch.equal(layer.codes, codes)
    assert torch.equal(layer.dequantize(), weight)
    assert layer.weight.dtype == dtype and layer.bias.dtype == dtype
    layer(torch.randn(2, 37, dtype=dtype)).float().sum().backward()
    assert layer.weight.grad.dtype == dtype
    layer.float()
    assert torch.equal(layer.scale, scale) and layer.weight.dtype == torch.float32


@pytest.mark.parametrize("requires_grad", [True, False])
def test_deepcopy_keeps_requires_grad(requires_grad):
    layer = _layer()
    layer.weight.requires_grad_(requires_grad)
    twin = copy.deepcopy(layer)
    assert twin.weight.requires_grad is requires_grad
    assert isinstance(twin.weight, nn.Parameter) and isinstance(twin.weight, QuantWeight)


def test_torch_save_of_a_whole_model_loads_back():
    model = nn.Sequential(_layer(bits=3, scale="row", seed=2), nn.Tanh(), nn.Linear(11, 2))
    model[0].weight.requires_grad_(False)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded[0].codes, model[0].codes)
    assert torch.equal(loaded[0].scale, model[0].scale)
    assert loaded[0].seed == model[0].seed and loaded[0].weight.requires_grad is False
    x = torch.randn(4, 37)
    assert torch.equal(loaded(x), model(x))


def test_state_dict_loads_with_weights_only():
    layer = _layer(bits=2, scale="row", seed=3)
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    other = _layer(bits=2, scale="row", seed=9)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(other.codes, layer.codes) and other.seed == layer.seed


def test_reading_the_weight_dequantizes_and_writing_it_is_refused():
    layer = _layer(scale="row")
    w = layer.dequantize()
    assert type(layer.weight * 2) is torch.Tensor
    assert torch.equal(layer.weight.detach() * 2, w * 2)
    x = torch.randn(3, 37)
    torch.testing.assert_close(nn.functional.linear(x, layer.weight, layer.bias), layer(x))
    (layer.weight * 3).sum().backward()  # autograd gives the weight its gradient
    assert torch.equal(layer.weight.grad, torch.full((11, 37), 3.0))
    codes = layer.codes.clone()
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="frugal_kernels.DQT"):
            layer.weight.add_(1)
        with pytest.raises(NotImplementedError, match="frugal_kernels.DQT"):
            torch._foreach_mul_([layer.weight], 0.5)
        with pytest.raises(TypeError, match="quantize_from"):
            layer.weight.copy_(torch.zeros(11, 37))
    assert torch.equal(layer.codes, codes)


def test_quantize_keeps_a_layer_shared_under_several_names_shared():
    """One Linear registered under two names used to be quantized under the first only,
    the second name keeping the float layer (unshared)."""
    model = _tiny_lm()
    shared = nn.Linear(16, 16)
    model.layers[0]["q"] = shared
    model.layers[1]["q"] = shared
    replaced = fk.quantize_(model)
    assert model.layers[0]["q"] is model.layers[1]["q"]
    assert isinstance(model.layers[1]["q"], QuantLinear)
    assert {"layers.0.q", "layers.1.q"} <= set(replaced)
    # One parameter for the optimizer, as before.
    assert sum(isinstance(p, QuantWeight) for p in model.parameters()) == 5


def test_quantize_that_fails_on_a_later_layer_changes_nothing():
    model = _tiny_lm()
    with torch.no_grad():
        model.layers[1]["down"].weight[0, 0] = float("nan")
    before = dict(model.named_modules())
    with pytest.raises(ValueError, match="non-finite"):
        fk.quantize_(model)
    assert dict(model.named_modules()) == before
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def _snapshot(module):
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in module.state_dict().items()}


def _assert_unchanged(module, before):
    after = module.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(after[key], value), key
        else:
            assert after[key] == value, key


@pytest.mark.parametrize("bits", _quant.QUANT_BITS)
def test_are_codes_equals_unpacking_and_checking_every_field(bits):
    """_quant.are_codes reads the packed bytes without unpacking them; held to unpack()
    on random bytes (valid or not) and on valid codes with one field set to all ones."""
    gen = torch.Generator().manual_seed(bits)
    qmax = _quant.qmax(bits)
    for cols in (1, 2, 3, 5, 8, 13, 37):
        width = _quant.packed_cols(cols, bits)
        pad = width * 8 - cols * bits
        for _ in range(50):
            packed = torch.randint(0, 256, (3, width), generator=gen).to(torch.uint8)
            if _ % 2:  # valid codes with one field all ones
                packed = _quant.pack(torch.randint(-qmax, qmax + 1, (3, cols), generator=gen),
                                     bits)
                c = int(torch.randint(0, cols, (), generator=gen))
                for b in range(c * bits, (c + 1) * bits):
                    packed[1, b // 8] |= 1 << (b % 8)
            expected = bool((_quant.unpack(packed, bits, cols) <= qmax).all()) and \
                (pad == 0 or not bool((packed[:, -1] >> (8 - pad)).any()))
            assert _quant.are_codes(packed, bits, cols) == expected, (cols, packed)
        valid = _quant.pack(torch.randint(-qmax, qmax + 1, (4, cols), generator=gen), bits)
        assert _quant.are_codes(valid, bits, cols)


# 8-bit rows have no padding bits.
@pytest.mark.parametrize("bits, where", [(bits, "field") for bits in _quant.QUANT_BITS] +
                         [(bits, "padding") for bits in _quant.QUANT_BITS if bits != 8])
def test_packed_codes_out_of_range_are_refused_and_change_nothing(bits, where):
    """A byte whose field lies above 2 * qmax (the code qmax + 1, which no width stores) or
    whose padding bits are set is no code of the layer's width: it used to load silently
    (and dequantize to a weight out of the codes' range)."""
    cols = 5 if where == "padding" else 37  # 5 columns leave padding at 2, 3 and 4 bits
    layer = QuantLinear(cols, 11, bits=bits, seed=3)
    sd = QuantLinear(cols, 11, bits=bits, seed=4).state_dict()
    codes = sd["codes"].clone()
    if where == "field":
        # Column 1's field of row 2 set to all ones: 2**bits - 1 > 2 * qmax.
        for b in range(bits, 2 * bits):
            codes[2, b // 8] |= 1 << (b % 8)
    else:
        codes[2, -1] |= 0x80
    sd["codes"] = codes
    before = _snapshot(layer)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=f"codes: .*not {bits}-bit codes"):
            layer.load_state_dict(sd, strict=strict)
        _assert_unchanged(layer, before)


@pytest.mark.parametrize("strict", [True, False])
def test_a_checkpoint_without_its_extra_state_is_refused_and_changes_nothing(strict):
    """A tensors-only state dict (the _extra_state dropped) does not say the codes' width:
    one of another width whose packed shape happens to match (2 columns at 2, 3 or 4 bits)
    used to load with strict=False, and even strict=True copied the codes before it raised
    on the missing key."""
    layer = QuantLinear(2, 11, bits=4, seed=3)
    before = _snapshot(layer)
    for bits in (2, 3, 4):
        sd = {k: v for k, v in QuantLinear(2, 11, bits=bits, seed=4).state_dict().items()
              if isinstance(v, torch.Tensor)}
        with pytest.raises(RuntimeError, match="_extra_state.*bits"):
            layer.load_state_dict(sd, strict=strict)
        _assert_unchanged(layer, before)
    sd = QuantLinear(2, 11, bits=4, seed=4).state_dict()
    sd["_extra_state"] = {"bits": 4}
    with pytest.raises(RuntimeError, match="extra state of an unknown format"):
        layer.load_state_dict(sd, strict=strict)
    _assert_unchanged(layer, before)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("checkpoint", ["float", "other width", "bad codes"])
def test_a_checkpoint_a_quantized_model_refuses_changes_nothing_of_the_model(checkpoint, strict):
    """A float checkpoint (or one of another width, or with bad codes) loaded into a model
    converted by quantize_ was refused by the QuantLinear layers, but torch had copied the
    embedding (before them) and the head (after them) by then. quantize_ puts a check on
    the model that reads every QuantLinear's entries before anything loads."""
    model = _tiny_lm()
    fk.quantize_(model, bits=4)
    if checkpoint == "float":
        sd = _tiny_lm().state_dict()
        match = "layers.0.q.weight: the checkpoint holds a float weight"
    else:
        other = _tiny_lm()
        fk.quantize_(other, bits=3 if checkpoint == "other width" else 4, seed=9)
        sd = other.state_dict()
        if checkpoint == "bad codes":
            sd["layers.1.down.codes"] = torch.full_like(sd["layers.1.down.codes"], 0xFF)
            match = "layers.1.down.codes: not 4-bit codes"
        else:
            match = "layers.0.q.: the checkpoint's layer has bits=3"
    for name in ("embed.weight", "lm_head.weight"):
        sd[name] = sd[name] + 1.0  # would show if copied
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=match):
        model.load_state_dict(sd, strict=strict)
    _assert_unchanged(model, before)
    # The check travels with the model: a saved and loaded whole model, and a deep copy.
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for copied in (torch.load(buf, weights_only=False), copy.deepcopy(model)):
        before = _snapshot(copied)
        with pytest.raises(RuntimeError, match=match):
            copied.load_state_dict(sd, strict=strict)
        _assert_unchanged(copied, before)
    # And is put on once, however often quantize_ runs on the model.
    fk.quantize_(model, bits=4)
    assert len(model._load_state_dict_pre_hooks) == 1
    good = copy.deepcopy(model)
    with torch.no_grad():
        good.embed.weight.add_(1.0)
    model.load_state_dict(good.state_dict())
    assert torch.equal(model.embed.weight, good.embed.weight)
