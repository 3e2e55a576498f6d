"""DQT under DistributedDataParallel and under FSDP2 (``fully_shard`` alone, and the
deprecated ``shard_quantized_``): two CPU ranks (gloo) against one process on the same global batch, and
torch.distributed.checkpoint across 2 -> 2, 2 -> 1 and 1 -> 2 ranks.

The stochastic rounding is keyed by (layer seed, step, element index), so ranks that
step a weight (DDP: all of it, FSDP2: their rows, keyed by the rows' global indices)
with the same gradient write the same codes as one process. The ranks' gradient is
the mean of the two halves of the batch, ``g0 / 2 + g1 / 2`` (halving is exact in
floating point); the one-process reference computes the two halves' gradients and
forms that sum, on one thread as the ranks run, so codes and parameters must match
bit for bit. Against one process on the whole batch at once the gradients
differ in their rounding, and sign-based updates may flip where a gradient is near
zero (DESIGN.md section 6): that comparison counts the codes that moved apart.

One spawn of two ranks runs every configuration (starting processes is the slow
part); the one-process runs and checkpoints are made in the test process.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import frugal_kernels as fk
from frugal_kernels._shard import RowShard, row_chunk
from frugal_kernels.nn import QuantLinear, QuantWeight, shard_quantized_

from .helpers import ddp_without_buffer_sync, end_rank, load, rendezvous, save

STEPS = 4
CUT = 2  # checkpoints are taken after CUT steps
BATCH = 8  # global; each of the two ranks takes half
# bits=2 with one scale per row (gathered with the codes under FSDP2), bits=4 per tensor.
CONFIGS = [f"{update}-{bits}" for update in ("adamw", "sign", "frugal") for bits in (4, 2)]
# Under fully_shard alone also update="frugal" of whole tensors (projection "blocks"; the
# others take "columns").
FULLY_SHARD_CONFIGS = CONFIGS + ["frugal+blocks-4"]


class Net(nn.Module):
    """Two quantized layers (the second of 5 rows: 3 and 2 over two ranks), a norm and a
    float head."""

    def __init__(self, name, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([nn.Linear(12, 16), nn.Linear(16, 5)])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(5, 1)
        bits = int(name.split("-")[1])
        fk.quantize_(self, bits=bits, skip=("head",), scale="row" if bits == 2 else "tensor",
                     seed=11)

    def forward(self, x):
        x = self.norm(torch.tanh(self.layers[0](x)))
        return self.head(torch.tanh(self.layers[1](x)))


def optimizer(name, model, **options):
    update, _, projection = name.split("-")[0].partition("+")
    return fk.DQT(model.parameters(), lr=2e-2, update=update, density=0.5, update_gap=2,
                  projection=projection or "columns", seed=7, **options)


def batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 12, generator=gen), torch.randn(BATCH, 1, generator=gen))
            for _ in range(STEPS)]


def train(model, opt, start=0, stop=STEPS, rank=0, world=1, state_bytes=None):
    per_rank = BATCH // world
    for x, y in batches()[start:stop]:
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        if state_bytes is not None:
            state_bytes.append(opt.state_bytes())
        opt.zero_grad()


@contextlib.contextmanager
def one_thread():
    """The ranks' thread count: LayerNorm's weight gradient on the CPU depends on it (its
    reduction is split by thread; seen one ulp apart, 1 against 2 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_by_halves(model, opt, start=0, stop=STEPS):
    """One process, the ranks' gradient exactly: each half's gradient halved, then added
    (DDP and FSDP2 divide by the rank count before they sum, and halving is exact)."""
    half = BATCH // 2
    params = [p for p in model.parameters() if p.requires_grad]
    for x, y in batches()[start:stop]:
        grads = []
        for rows in (slice(0, half), slice(half, BATCH)):
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            grads.append([p.grad.div(2) for p in params])
            opt.zero_grad()
        for p, g0, g1 in zip(params, *grads):
            p.grad = g0 + g1
        opt.step()
        opt.zero_grad()


def codes(model):
    """Every quantized layer's whole codes (gathered from the ranks under FSDP2)."""
    from torch.distributed.tensor import DTensor

    out = []
    for m in model.modules():
        if isinstance(m, QuantLinear):
            if m.shard is not None:
                out.append(m.shard.gather(m.codes))
            elif isinstance(m.weight, DTensor):  # fully_shard: the state dict's global form
                out.append(m.state_dict()["codes"].full_tensor())
            else:
                out.append(m.codes.clone())
    return out


def quantized(p):
    """Whether ``p`` is a quantized weight (under fully_shard a DTensor of QuantWeights)."""
    return isinstance(getattr(p, "_local_tensor", p), QuantWeight)


def floats(model):
    """The float parameters, whole (a DTensor gathered), in module order."""
    from torch.distributed.tensor import DTensor

    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for p in model.parameters() if not quantized(p)]


def quant_state_bytes(opt):
    return sum(v.numel() * v.element_size() for p, st in opt.state.items()
               if isinstance(p, QuantWeight) for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    weights = set(shard_quantized_(model, mesh))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=weights)
    fully_shard(model, mesh=mesh, ignored_params=weights)
    return model


def fully_sharded(model, mesh):
    """FSDP2 by ``fully_shard`` alone: it shards the QuantWeights too (their all-gather
    hooks exchange packed codes)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fully_shard_checkpoints(name, mesh, rank, world, out):
    """The fully_shard runs resumed from a checkpoint after CUT steps: of 2 ranks, and of
    one process (saved by the test process)."""
    model = fully_sharded(Net(name), mesh)
    opt = optimizer(name, model)
    train(model, opt, 0, CUT, rank, world)
    save(model, opt, os.path.join(out, f"fully_shard-{name}-2"))
    runs = {}
    for what, path in (("resumed", f"fully_shard-{name}-2"), ("from_one", f"{name}-1")):
        model = fully_sharded(Net(name, seed=5), mesh)
        opt = optimizer(name, model)
        load(model, opt, os.path.join(out, path))
        train(model, opt, CUT, STEPS, rank, world)
        runs[what] = result(model, opt)
    return runs


def result(model, opt, **extra):
    return {"codes": codes(model), "floats": floats(model), **extra}


def _rank(rank, world, init_method, out):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name in CONFIGS:
        # DDP: the ranks' models are built apart (another seed on the second rank) and
        # made equal by broadcasting the state dict's tensors, as DDP's own initial sync
        # would (it cannot concatenate the QuantWeights' packed codes: init_sync=False).
        model = Net(name, seed=0 if rank == 0 else 3)
        for value in model.state_dict().values():
            if isinstance(value, torch.Tensor):
                dist.broadcast(value, src=0)
        ddp = ddp_without_buffer_sync(model)
        opt = optimizer(name, model)
        state_bytes = []
        train(ddp, opt, rank=rank, world=world, state_bytes=state_bytes)
        results[f"ddp-{name}"] = result(model, opt, state_bytes=state_bytes)

        # FSDP2, uninterrupted.
        model = fsdp(Net(name), mesh)
        opt = optimizer(name, model)
        state_bytes = []
        train(model, opt, rank=rank, world=world, state_bytes=state_bytes)
        results[name] = result(model, opt, state_bytes=state_bytes,
                               quant_state_bytes=quant_state_bytes(opt),
                               dequantized=[m.dequantize() for m in model.layers])

        # 2 -> 2: save after CUT steps, resume in a fresh model and optimizer.
        model = fsdp(Net(name), mesh)
        opt = optimizer(name, model)
        train(model, opt, 0, CUT, rank, world)
        save(model, opt, os.path.join(out, f"{name}-2"))
        model = fsdp(Net(name, seed=5), mesh)
        opt = optimizer(name, model)
        load(model, opt, os.path.join(out, f"{name}-2"))
        train(model, opt, CUT, STEPS, rank, world)
        results[name]["resumed"] = result(model, opt)

        # 1 -> 2: the test process saved after CUT one-process steps.
        model = fsdp(Net(name, seed=5), mesh)
        opt = optimizer(name, model)
        load(model, opt, os.path.join(out, f"{name}-1"))
        train(model, opt, CUT, STEPS, rank, world)
        results[name]["from_one"] = result(model, opt)

    for name in FULLY_SHARD_CONFIGS:
        # FSDP2 by fully_shard alone, uninterrupted and through 2 -> 2 and 1 -> 2
        # checkpoints.
        model = fully_sharded(Net(name), mesh)
        opt = optimizer(name, model)
        train(model, opt, rank=rank, world=world)
        results[f"fully_shard-{name}"] = result(model, opt, dequantized=[
            (m.dequantize(), m.dequantize(torch.bfloat16), m.weight.full_tensor())
            for m in model.layers])
        results[f"fully_shard-{name}"].update(fully_shard_checkpoints(name, mesh, rank,
                                                                      world, out))

    # FRUGAL's rows and randk draw along the rows, which the ranks hold in part.
    results["rows_refused"] = error_of(lambda: fk.DQT(fsdp(Net("frugal-4"), mesh).parameters(),
                                                      update="frugal", projection="rows"))
    results["fully_shard_rows_refused"] = error_of(lambda: fk.DQT(
        fully_sharded(Net("frugal-4"), mesh).parameters(), update="frugal", projection="rows"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shard_quantized_(Net("adamw-4"), mesh)
    results["deprecated"] = [str(w.message) for w in caught
                             if issubclass(w.category, DeprecationWarning)]
    # DDP's own initial broadcast cannot flatten a QuantWeight (hence init_sync=False):
    # refused before it writes, with the recipe (frugal_kernels.nn._ddp).
    results["ddp_init_sync"] = error_of(
        lambda: nn.parallel.DistributedDataParallel(Net("adamw-4")), RuntimeError)
    # A 2-D mesh (HSDP) and a second sharding are refused.
    results["mesh_2d"] = error_of(
        lambda: shard_quantized_(Net("adamw-4"), init_device_mesh("cpu", (1, world))))
    sharded = Net("adamw-2")
    shard_quantized_(sharded, mesh)
    results["twice"] = error_of(lambda: shard_quantized_(sharded, mesh))
    results["collectives"] = count_shard_collectives(mesh, rank, world)
    results["nonfinite"] = nonfinite_on_one_rank(mesh, rank)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    end_rank()


def error_of(fn, kind=ValueError):
    """The message of the ``kind`` error ``fn`` raises ("" if none)."""
    try:
        fn()
    except kind as e:
        return str(e)
    return ""


def nonfinite_on_one_rank(mesh, rank):
    """Whether the split codes changed on this rank in a step where only the first rank's
    rows have a NaN gradient, on a model with nothing for FSDP2 (so the ranks' only
    link is the split layers')."""
    torch.manual_seed(0)
    model = nn.Sequential(QuantLinear(12, 6, bias=False), nn.Tanh(), QuantLinear(6, 2, bias=False))
    shard_quantized_(model, mesh)
    opt = fk.DQT(model.parameters(), lr=5e-2, update="sign")
    x, _ = batches()[0]
    changed = {}
    for name in ("nan", "finite"):
        before = codes(model)
        model(x[:4]).sum().backward()
        if name == "nan" and rank == 0:
            model[0].weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
        changed[name] = [not torch.equal(a, b) for a, b in zip(before, codes(model))]
    return changed


def count_shard_collectives(mesh, rank, world):
    """How often the split layers gather and reduce-scatter in one forward, backward and
    step (of a model with two split layers and row scales)."""
    counts = {"gather": 0, "reduce_scatter_mean": 0}
    phase = {}
    real = {name: getattr(RowShard, name) for name in counts}

    def counting(name):
        def call(self, *args):
            counts[name] += 1
            return real[name](self, *args)
        return call
    model = fsdp(Net("sign-2"), mesh)
    opt = optimizer("sign-2", model)
    x, y = batches()[0]
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for name in counts:
        setattr(RowShard, name, counting(name))
    try:
        out = model(x[rows])
        phase["forward"] = dict(counts)
        nn.functional.mse_loss(out, y[rows]).backward()
        phase["backward"] = dict(counts)
        opt.step()
        phase["step"] = dict(counts)
    finally:
        for name, fn in real.items():
            setattr(RowShard, name, fn)
    return phase


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dqt"))
    for name in FULLY_SHARD_CONFIGS:
        model = Net(name)
        opt = optimizer(name, model)
        with one_thread():
            train_by_halves(model, opt, 0, CUT)
        save(model, opt, os.path.join(out, f"{name}-1"))
    mp.spawn(_rank, args=(2, rendezvous(out), out), nprocs=2, join=True)
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in (0, 1)]
    return out, ranks


def by_halves(name, start=0, path=None, state_bytes=None):
    model = Net(name, seed=0 if path is None else 5)
    opt = optimizer(name, model)
    if path is not None:
        load(model, opt, path)
    if state_bytes is None:
        with one_thread():
            train_by_halves(model, opt, start)
    else:
        # state_bytes does not depend on how the gradient was summed.
        train(model, opt, start, state_bytes=state_bytes)
    return model, opt


def assert_equal_runs(got, model, where):
    for a, b in zip(got["codes"], codes(model)):
        assert torch.equal(a, b), where
    for a, b in zip(got["floats"], floats(model)):
        assert torch.equal(a, b), where


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", CONFIGS)
def test_ranks_write_the_codes_of_one_process(runs, name, mode):
    _, ranks = runs
    key = f"ddp-{name}" if mode == "ddp" else name
    rank0, rank1 = ranks[0][key], ranks[1][key]
    for a, b in zip(rank0["codes"] + rank0["floats"], rank1["codes"] + rank1["floats"]):
        assert torch.equal(a, b), key
    model, _ = by_halves(name)
    assert_equal_runs(rank0, model, key)
    # The run moved the codes (a comparison of untouched codes would prove nothing).
    assert any(not torch.equal(a, b) for a, b in zip(rank0["codes"], codes(Net(name)))), key


@pytest.mark.parametrize("name", FULLY_SHARD_CONFIGS)
def test_fully_shard_alone_writes_the_codes_of_one_process(runs, name):
    """FSDP2 with no ignored_params and no shard_quantized_: fully_shard splits the
    QuantWeights by rows, gathers their packed codes through the subclass's hooks, and
    the ranks' DQT steps write what one process writes, bit for bit."""
    _, ranks = runs
    key = f"fully_shard-{name}"
    rank0, rank1 = ranks[0][key], ranks[1][key]
    for a, b in zip(rank0["codes"] + rank0["floats"], rank1["codes"] + rank1["floats"]):
        assert torch.equal(a, b), key
    model, _ = by_halves(name)
    assert_equal_runs(rank0, model, key)
    assert any(not torch.equal(a, b) for a, b in zip(rank0["codes"], codes(Net(name)))), key


@pytest.mark.parametrize("name", CONFIGS)
def test_a_whole_batch_process_differs_by_sign_flips_at_most(runs, name):
    _, ranks = runs
    model = Net(name)
    train(model, optimizer(name, model))
    for a, b in zip(ranks[0][name]["codes"], codes(model)):
        # A flip moves a code by one or two steps; measured: none in these runs.
        assert float((a != b).float().mean()) <= 0.02, name
    for a, b in zip(ranks[0][name]["floats"], floats(model)):
        assert float(((a - b).abs() > 1e-5).float().mean()) <= 0.02, name


@pytest.mark.parametrize("name", CONFIGS)
def test_fsdp_ranks_hold_the_state_of_their_rows(runs, name):
    _, ranks = runs
    one = []
    _, opt = by_halves(name, state_bytes=one)
    for t, expected in enumerate(one):
        per_rank = [r[name]["state_bytes"][t] for r in ranks]
        # Half each, but for the 5-row layer (3 and 2 rows), the step counts every rank
        # holds and the columns' ids every rank holds whole.
        assert max(per_rank) <= 0.6 * expected, (name, t, per_rank, expected)
        assert sum(per_rank) >= expected, (name, t, per_rank, expected)
        # Under DDP every rank holds it all.
        assert [r[f"ddp-{name}"]["state_bytes"][t] for r in ranks] == [expected] * 2, name
    # The quantized weights' moments are the ranks' rows: between them, one process's.
    # Each weight's moments split as its rows (8 and 8 of 16, 3 and 2 of 5); the column
    # ids of update="frugal" are every rank's.
    expected = [0, 0]
    for p, st in opt.state.items():
        if isinstance(p, QuantWeight):
            rows = p.shape[0]
            for r in (0, 1):
                share = row_chunk(rows, 2, r)[1]
                expected[r] += sum(v.numel() * v.element_size() *
                                   (share if key.startswith("exp_avg") else rows) // rows
                                   for key, v in st.items() if v.dim() > 0)
    quant = [r[name]["quant_state_bytes"] for r in ranks]
    assert quant == expected, (name, quant, expected)
    assert (sum(expected) == 0) == name.startswith("sign"), (name, expected)


@pytest.mark.parametrize("name", CONFIGS)
def test_dequantize_gathers_the_whole_weight(runs, name):
    _, ranks = runs
    model, _ = by_halves(name)
    for got, layer in zip(ranks[1][name]["dequantized"], model.layers):
        assert torch.equal(got, layer.dequantize())


@pytest.mark.parametrize("name", FULLY_SHARD_CONFIGS)
def test_dequantize_under_fully_shard_gathers_the_whole_weight(runs, name):
    """As nn.Linear's weight.full_tensor() would: every rank gets the whole weight (the
    5-row layer's 3 and 2 rows included), in the dtype asked for, not its own rows; and
    the weight's own full_tensor() is that weight too."""
    _, ranks = runs
    model, _ = by_halves(name)
    for r in ranks:
        for (fp32, bf16, full), layer in zip(r[f"fully_shard-{name}"]["dequantized"],
                                             model.layers):
            assert torch.equal(fp32, layer.dequantize()), name
            assert torch.equal(bf16, layer.dequantize(torch.bfloat16)), name
            assert type(full) is torch.Tensor and torch.equal(full, layer.dequantize()), name


@pytest.mark.parametrize("name", CONFIGS)
def test_a_checkpoint_resumes_on_two_ranks(runs, name):
    _, ranks = runs
    for r in ranks:
        for a, b in zip(r[name]["resumed"]["codes"] + r[name]["resumed"]["floats"],
                        r[name]["codes"] + r[name]["floats"]):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("name", CONFIGS)
def test_a_checkpoint_of_two_ranks_resumes_in_one_process(runs, name):
    out, ranks = runs
    model, _ = by_halves(name, CUT, path=os.path.join(out, f"{name}-2"))
    assert_equal_runs(ranks[0][name], model, name)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_checkpoint_of_one_process_resumes_on_two_ranks(runs, name):
    _, ranks = runs
    model, _ = by_halves(name)
    assert_equal_runs(ranks[0][name]["from_one"], model, name)


def test_row_subsets_are_refused_on_split_rows(runs):
    _, ranks = runs
    assert "projection columns or blocks" in ranks[0]["rows_refused"]


def test_fully_shard_refuses_row_subsets_and_shard_quantized_is_deprecated(runs):
    _, ranks = runs
    assert "projection columns or blocks" in ranks[0]["fully_shard_rows_refused"]
    assert any("fully_shard" in message for message in ranks[0]["deprecated"])


@pytest.mark.parametrize("name", FULLY_SHARD_CONFIGS)
def test_fully_shard_checkpoints_resume_exactly(runs, name):
    """2 ranks -> 2 ranks and 1 process -> 2 ranks through torch.distributed.checkpoint,
    under fully_shard alone: the uninterrupted run, bit for bit. update="frugal" too: its
    column subset's moments are saved as DTensors of [rows, k], not of the weight's
    shape (which DCP refused at the load: "mismatch sizes [8, 12] vs [8, 6])."""
    _, ranks = runs
    key = f"fully_shard-{name}"
    model, _ = by_halves(name)
    for r in ranks:
        for what in ("resumed", "from_one"):
            for a, b in zip(r[key][what]["codes"] + r[key][what]["floats"],
                            r[key]["codes"] + r[key]["floats"]):
                assert torch.equal(a, b), (key, what)
    assert_equal_runs(ranks[0][key]["resumed"], model, key)


@pytest.mark.parametrize("name", FULLY_SHARD_CONFIGS)
def test_a_fully_shard_checkpoint_resumes_in_one_process(runs, name):
    """2 ranks -> 1 process: the DTensors of the ranks' rows load as whole tensors."""
    out, ranks = runs
    model, _ = by_halves(name, CUT, path=os.path.join(out, f"fully_shard-{name}-2"))
    assert_equal_runs(ranks[0][f"fully_shard-{name}"], model, name)


def test_refusals(runs):
    _, ranks = runs
    # Plain DDP points to the recipe (torch's own error comes from its C++ flattening
    # and names no cause).
    assert "init_sync=False, forward_sync_buffers=False" in ranks[0]["ddp_init_sync"]
    assert "DQT under DDP" in ranks[0]["ddp_init_sync"]
    assert "1-D DeviceMesh" in ranks[0]["mesh_2d"]
    assert "sharded already" in ranks[0]["twice"]


def test_split_layers_gather_for_each_pass_and_reduce_scatter_the_gradient(runs):
    _, ranks = runs
    # Two layers with row scales: forward gathers codes and scales of each (4); backward
    # gathers them again where the input needs a gradient (the second layer: 2; the
    # first one's input is the data) and reduce-scatters each weight's gradient (2); the
    # step exchanges nothing of the split layers.
    assert ranks[0]["collectives"] == {
        "forward": {"gather": 4, "reduce_scatter_mean": 0},
        "backward": {"gather": 6, "reduce_scatter_mean": 2},
        "step": {"gather": 6, "reduce_scatter_mean": 2}}


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(runs):
    _, ranks = runs
    # nonfinite="skip": the ranks decide together (an all-reduce over the split layers'
    # group), so neither writes its codes.
    assert ranks[0]["nonfinite"] == ranks[1]["nonfinite"]
    assert ranks[0]["nonfinite"]["nan"] == [False, False]
    assert ranks[0]["nonfinite"]["finite"] == [True, True]  # a step does move them
