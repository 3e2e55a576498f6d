"""``ops.linear_cross_entropy``, the fused output layer and loss, on every backend that runs on
CPU tensors (torch; triton under the interpreter).

Out of place and not an optimizer step, so not an entry of the op table's generic tests
(tests/op_db.py lists it among OUT_OF_PLACE_OPS); it gets the table's checks here: the
loss, the gradients of hidden, weight and bias and the scores against the reference
(``reference.linear_cross_entropy``, full fp32 logits through F.cross_entropy) over
every reduction, label smoothing, ignored tokens, odd and empty sizes, several chunks,
dtypes; bad input refused; opcheck; torch.compile.
"""

import importlib

import pytest
import torch

from frugal_kernels import ops, reference

from .helpers import DTYPES, cpu_backends, rel_diff

# The module (ops.linear_cross_entropy is the function of the same name).
lce_module = importlib.import_module("frugal_kernels.ops.linear_cross_entropy")
BACKENDS = cpu_backends("frugal::linear_cross_entropy")
SCORES = ("loss", "el2n", "grad_norm")
# (N, D, V): odd sizes, one token, one class, empty N.
SHAPES = [(37, 19, 53), (1, 5, 3), (9, 4, 1), (0, 6, 11), (64, 16, 130)]
# fp32 sums in another order than the reference's GEMM: far below any wrong term.
FP32_REL = 2e-5
# 16-bit inputs: both sides compute in fp32; the gradients are rounded once to the
# input dtype (bf16 keeps 8 bits: 2^-8 relative to the largest value, plus one ulp).
HALF_REL = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9}


def case(n, d, v, dtype=torch.float32, bias=True, ignored=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(dtype)
    weight = (torch.randn(v, d, generator=g) / d ** 0.5).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    if ignored:
        targets[::4] = -100
    return hidden, weight, b, targets


def run(fn, hidden, weight, bias, targets, grad_seed=1, **options):
    """fn's loss and scores, and the gradients of ``sum(loss * r)`` (r random)."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    if bias is not None:
        leaves.append(bias.detach().clone().requires_grad_())
    b = leaves[2] if bias is not None else None
    if fn is reference.linear_cross_entropy:
        loss, scores = fn(leaves[0], leaves[1], targets, b, **options)
    else:
        loss, scores = fn(leaves[0], leaves[1], targets, bias=b, **options)
    r = torch.randn(loss.shape, generator=torch.Generator().manual_seed(grad_seed)) + 2
    grads = torch.autograd.grad((loss * r).sum(), leaves, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    return loss.detach(), scores, grads


def assert_close(actual, expected, dtype, what):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.numel() == 0:
        return
    if torch.isnan(expected).all():
        assert torch.isnan(actual).all(), f"{what}: expected NaN"
        return
    bound = FP32_REL if dtype == torch.float32 else HALF_REL[dtype]
    r = rel_diff(actual.float(), expected.float())
    assert r <= bound, f"{what}: relative difference {r:.3g} > {bound}"


def check_against_reference(backend, dtype, shape, reduction, smoothing, bias, seed=0):
    hidden, weight, b, targets = case(*shape, dtype=dtype, bias=bias, seed=seed)
    options = dict(reduction=reduction, label_smoothing=smoothing, scores=SCORES)
    loss, scores, grads = run(ops.linear_cross_entropy, hidden, weight, b, targets,
                              backend=backend, **options)
    ref_loss, ref_scores, ref_grads = run(reference.linear_cross_entropy, hidden, weight, b,
                                          targets, **options)
    what = f"{shape} {reduction} eps={smoothing} bias={bias}"
    assert loss.dtype == torch.float32
    # The loss and scores come from fp32 logits on both sides, whatever the input dtype.
    assert_close(loss, ref_loss, torch.float32, f"loss {what}")
    for name in SCORES:
        assert scores[name].dtype == torch.float32
        assert_close(scores[name], ref_scores[name], torch.float32, f"score {name} {what}")
    for name, g, e, t in zip(("hidden", "weight", "bias"), grads, ref_grads,
                             (hidden, weight, b)):
        assert g.dtype == t.dtype, f"grad {name} dtype"
        assert_close(g, e.to(t.dtype), dtype, f"grad {name} {what}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_gradients_and_scores_match_the_reference(backend, reduction, smoothing,
                                                        monkeypatch):
    # Chunks of 7 * 130 / V rows in the torch backend: several chunks, a ragged last one.
    monkeypatch.setattr(lce_module, "CHUNK_BYTES", 4 * 130 * 7)
    monkeypatch.setattr(lce_module, "MIN_ROWS", 1)
    for i, shape in enumerate(SHAPES):
        check_against_reference(backend, torch.float32, shape, reduction, smoothing,
                                bias=i % 2 == 0, seed=i)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
def test_16_bit_inputs_accumulate_in_fp32(backend, dtype):
    for reduction in ("mean", "none"):
        check_against_reference(backend, dtype, (33, 24, 70), reduction, 0.05, bias=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_chunk_and_many_chunks_agree(backend, monkeypatch):
    hidden, weight, b, targets = case(50, 8, 40, seed=3)
    whole = run(ops.linear_cross_entropy, hidden, weight, b, targets, backend=backend,
                scores=SCORES)
    monkeypatch.setattr(lce_module, "CHUNK_BYTES", 1)  # one row per chunk
    monkeypatch.setattr(lce_module, "MIN_ROWS", 1)
    rows = run(ops.linear_cross_entropy, hidden, weight, b, targets, backend=backend,
               scores=SCORES)
    assert_close(rows[0], whole[0], torch.float32, "loss")
    for g, e in zip(rows[2], whole[2]):
        assert_close(g, e, torch.float32, "grads")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_tokens(backend):
    """Ignored tokens: loss 0 and every score 0, no gradient; a mean over no token is NaN
    (as F.cross_entropy) with zero gradients."""
    hidden, weight, b, targets = case(12, 5, 9, seed=4)
    loss, scores, grads = run(ops.linear_cross_entropy, hidden, weight, b, targets,
                              backend=backend, reduction="none", scores=SCORES)
    ignored = targets == -100
    assert ignored.any() and (loss[ignored] == 0).all() and (loss[~ignored] > 0).all()
    for name in SCORES:
        assert (scores[name][ignored] == 0).all() and (scores[name][~ignored] > 0).all()
    assert (grads[0][ignored] == 0).all() and (grads[0][~ignored] != 0).any()
    loss, _, grads = run(ops.linear_cross_entropy, hidden, weight, b,
                         torch.full_like(targets, -100), backend=backend)
    assert torch.isnan(loss)
    assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dimensions_and_int32_targets(backend):
    hidden, weight, b, targets = case(12, 5, 9, seed=5)
    flat, flat_scores = ops.linear_cross_entropy(hidden, weight, targets, bias=b,
                                                 reduction="none", scores=("el2n",),
                                                 backend=backend)
    loss, scores = ops.linear_cross_entropy(hidden.reshape(3, 4, 5), weight,
                                            targets.reshape(3, 4).int(), bias=b,
                                            reduction="none", scores=("el2n",),
                                            backend=backend)
    assert loss.shape == (3, 4) and scores["el2n"].shape == (3, 4)
    assert torch.equal(loss.flatten(), flat)
    assert torch.equal(scores["el2n"].flatten(), flat_scores["el2n"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_without_autograd(backend):
    """A no-grad forward (an online selector's scoring pass) computes no gradient and
    gives the scores of a forward with gradients."""
    hidden, weight, b, targets = case(20, 6, 15, seed=6)
    with torch.no_grad():
        loss, scores = ops.linear_cross_entropy(hidden, weight, targets, bias=b,
                                                scores=SCORES, backend=backend)
    assert not loss.requires_grad
    out = torch.ops.frugal.linear_cross_entropy(hidden, weight, targets, b, -100, 0.0, "mean",
                                                "loss,el2n,grad_norm", False, backend)
    assert [t.numel() for t in out[3:]] == [0, 0, 0]
    _, ref_scores, _ = run(reference.linear_cross_entropy, hidden, weight, b, targets,
                           scores=SCORES)
    for name in SCORES:
        assert torch.equal(scores[name], out[1][SCORES.index(name)])
        assert_close(scores[name], ref_scores[name], torch.float32, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recomputed_backward_equals_the_precomputed_one(backend):
    """The backward op (logits recomputed from the saved log-sum-exp) and the gradients
    computed in the forward pass agree."""
    hidden, weight, b, targets = case(21, 7, 17, seed=7)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    for compute_grads in (True, False):
        loss = torch.ops.frugal.linear_cross_entropy(*leaves[:2], targets, leaves[2], -100,
                                                     0.1, "mean", "", compute_grads,
                                                     backend)[0]
        (3 * loss).backward()
    for t in leaves:
        # Accumulated twice: the second half must equal the first.
        half = t.grad / 2
        fresh = [x.clone().requires_grad_() for x in (hidden, weight, b)]
        ref, _ = reference.linear_cross_entropy(fresh[0], fresh[1], targets, fresh[2],
                                                label_smoothing=0.1)
        (3 * ref).backward()
        expected = fresh[[id(x) for x in leaves].index(id(t))].grad
        assert_close(half, expected, torch.float32, "grad")


def _errors():
    hidden, weight, b, targets = case(6, 4, 9, seed=8)
    base = dict(hidden=hidden, weight=weight, targets=targets, bias=b)
    return [
        ("hidden dtype", dict(base, hidden=hidden.double()), TypeError,
         "hidden must be torch.float32"),
        ("weight dtype", dict(base, weight=weight.half()), TypeError, "weight has dtype"),
        ("weight shape", dict(base, weight=weight[:, :3]), ValueError, "weight must be [V, 4]"),
        ("empty vocabulary", dict(base, weight=weight[:0], bias=None), ValueError, "V >= 1"),
        ("targets dtype", dict(base, targets=targets.float()), TypeError,
         "targets must be torch.int64 or torch.int32"),
        ("targets shape", dict(base, targets=targets[:5]), ValueError,
         "targets must have hidden's leading shape"),
        ("target out of range", dict(base, targets=torch.tensor([0, 1, 9, 2, 3, 4])),
         ValueError, "target 9 is out of range for a vocabulary of 9"),
        ("negative target", dict(base, targets=torch.tensor([0, 1, -1, 2, 3, 4])),
         ValueError, "target -1 is out of range"),
        ("bias shape", dict(base, bias=b[:4]), ValueError, "bias must be torch.float32 of shape"),
        ("bias dtype", dict(base, bias=b.double()), ValueError, "bias must be torch.float32"),
        ("device", dict(base, weight=weight.to("meta")), ValueError, "weight is on meta"),
        ("smoothing", dict(base, label_smoothing=1.5), ValueError,
         "label_smoothing must be in [0, 1]"),
        ("reduction", dict(base, reduction="avg"), ValueError, "reduction must be one of"),
        ("score name", dict(base, scores=("loss", "entropy")), ValueError,
         "unknown score 'entropy'"),
        ("score twice", dict(base, scores=("el2n", "el2n")), ValueError, "name one score twice"),
        ("scores string", dict(base, scores="el2n"), TypeError, "sequence of names"),
        ("not a tensor", dict(base, hidden=hidden.tolist()), TypeError, "hidden is a list"),
        ("backend", dict(base, backend="cpu"), ValueError, "has no cpu implementation"),
    ]


@pytest.mark.parametrize("name,kwargs,error,match", _errors(), ids=[e[0] for e in _errors()])
def test_bad_input_raises_and_changes_nothing(name, kwargs, error, match):
    tensors = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)
               and v.device.type == "cpu"}
    with pytest.raises(error, match=match.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        ops.linear_cross_entropy(**kwargs)
    for k, v in tensors.items():
        assert torch.equal(kwargs[k], v), f"{k} changed"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("reduction,compute_grads", [("mean", True), ("sum", False),
                                                     ("none", False)])
def test_opcheck(backend, bias, reduction, compute_grads):
    hidden, weight, b, targets = case(10, 6, 13, bias=bias, seed=9)
    hidden.requires_grad_()
    weight.requires_grad_()
    torch.library.opcheck(torch.ops.frugal.linear_cross_entropy.default,
                          (hidden, weight, targets, b, -100, 0.1, reduction, "loss,el2n",
                           compute_grads, backend))
    lse = torch.logsumexp(hidden.detach() @ weight.detach().t() +
                          (0 if b is None else b), dim=1)
    grad = torch.rand(10) if reduction == "none" else torch.tensor(0.5)
    torch.library.opcheck(torch.ops.frugal.linear_cross_entropy_backward.default,
                          (grad, hidden.detach(), weight.detach(), targets, b, lse, -100, 0.1,
                           reduction, backend))


def test_compiles_with_torch_compile():
    hidden, weight, b, targets = case(8, 5, 11, seed=10)
    weight.requires_grad_()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss_of(h):
        return ops.linear_cross_entropy(torch.tanh(h), weight, targets, bias=b)[0]

    compiled = loss_of(hidden)
    compiled.backward()
    expected = reference.linear_cross_entropy(torch.tanh(hidden), weight, targets, b)[0]
    assert_close(compiled.detach(), expected.detach(), torch.float32, "loss")
    grad = weight.grad.clone()
    weight.grad = None
    expected.backward()
    assert_close(grad, weight.grad, torch.float32, "grad weight")


def test_a_second_backward_is_refused():
    """The gradients computed in the forward pass are handed to autograd by the first
    backward (no copy at the peak); a second one says so instead of giving wrong values."""
    hidden, weight, b, targets = case(6, 4, 5, seed=11)
    weight.requires_grad_()
    loss, _ = ops.linear_cross_entropy(hidden, weight, targets, bias=b, backend="torch")
    loss.backward(retain_graph=True)
    first = weight.grad.clone()
    with pytest.raises(RuntimeError, match="a second backward through it"):
        loss.backward()
    assert torch.equal(weight.grad, first)


@pytest.mark.parametrize("n,d,v,chunk_bytes", [(64, 1024, 8192, None), (1024, 64, 8192, 8 << 20)],
                         ids=["weight-sized", "four chunks"])
def test_peak_beyond_inputs_and_gradients_is_one_chunk(n, d, v, chunk_bytes, monkeypatch):
    """The process's resident peak over a forward and backward (the benchmark's probe),
    beyond the inputs and the returned gradients, is the one chunk of logits: a weight of
    32 MiB makes a weight-sized temporary (autograd's zeros for the gradient outputs, 32
    MiB) stand out; four chunks below glibc's mmap threshold, a fresh buffer per chunk (the
    heap grew to two chunks when it did not fit the freed one's hole)."""
    from frugal_kernels.bench.loss import measure_memory

    if chunk_bytes is not None:
        monkeypatch.setattr(lce_module, "CHUNK_BYTES", chunk_bytes)
    chunk = min(n, lce_module._Torch._rows(v)) * v * 4
    result = measure_memory("fused", n, d, v)
    assert result["peak_kind"] == "rss_peak"
    assert result["grad_bytes"] == (n + v) * d * 4
    assert result["beyond_bytes"] <= chunk + (1 << 20), result
