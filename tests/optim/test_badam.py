"""BAdam against an independent reference: torch.optim.AdamW on the active block only,
the other parameters frozen, rebuilt at every switch."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
from torch import nn

import frugal_kernels as fk
from frugal_kernels.governor import Decision

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
SWITCH_EVERY = 3
MODES = ("random", "ascending", "descending", "fixed")
# For "fixed": a given order, a strict subset of the blocks out of their order.
FIXED_ORDER = ["model.layers.2", "embedding", "model.layers.0"]


class Toy(nn.Module):
    """Named like HF Llama: model.embed_tokens, model.layers.N, model.norm, lm_head."""

    def __init__(self, num_layers: int = 3, width: int = 6, vocab: int = 11, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, width)
        self.model.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(num_layers))
        self.model.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def loss(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, self.lm_head.out_features, (4, 5), generator=gen)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = torch.tanh(layer(x)) + x
        logits = self.lm_head(self.model.norm(x))
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def badam(model, mode="ascending", **kw):
    kw.setdefault("switch_every", SWITCH_EVERY)
    if mode == "fixed":
        kw.setdefault("order", FIXED_ORDER)
    return fk.BAdam(model, switch_mode=mode, include_embedding=True, include_head=True, **kw,
                    **HYPER)


def block_params(model, block):
    return [p for n, p in model.named_parameters()
            if (block == "embedding" and "embed_tokens" in n)
            or (block == "head" and n.startswith("lm_head."))
            or n.startswith(block + ".")]


NAMES = ["embedding", "model.layers.0", "model.layers.1", "model.layers.2", "head"]


def train_only(model, block):
    """Freeze every parameter of ``model`` but ``block``'s (as BAdam does); returns those."""
    for p in model.parameters():
        p.requires_grad_(False)
        p.grad = None
    active = block_params(model, block)
    for p in active:
        p.requires_grad_(True)
    return active


def expected_order(mode, steps):
    cycle = {"ascending": NAMES, "descending": NAMES[::-1], "fixed": FIXED_ORDER}[mode]
    return [cycle[(t // SWITCH_EVERY) % len(cycle)] for t in range(steps)]


def snapshot(model):
    return {n: (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_matches_adamw_on_the_active_block(mode):
    steps = 5 * SWITCH_EVERY * len(NAMES) // 2  # several switches and, for random, two epochs
    model, ref = Toy(), Toy()
    opt = badam(model, mode)
    order = [] if mode == "random" else expected_order(mode, steps)
    ref_opt = None
    for t in range(steps):
        block = opt.active_block
        if mode != "random":
            assert block == order[t]
        # Rebuilt at every switch, also when "random" draws the same block again
        # across an epoch boundary: each switch starts the block's AdamW afresh.
        if t % SWITCH_EVERY == 0:
            active = train_only(ref, block)
            ref_opt = torch.optim.AdamW(active, foreach=False, **HYPER)
        for m, o in ((model, opt), (ref, ref_opt)):
            m.loss(t).backward()
            o.step()
            o.zero_grad()
    assert len(opt.history) - 1 == steps // SWITCH_EVERY
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        # Gradients come through the loss, so one-ulp differences of the fused op's
        # arithmetic grow a little over the run: hence the small atol beside rtol.
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=name)


def test_random_mode_visits_every_block_once_per_epoch():
    opt = badam(Toy(), "random", seed=3)
    seen = [h["block"] for h in opt_steps(opt, 3 * len(NAMES) * SWITCH_EVERY)]
    epochs = [seen[i:i + len(NAMES)] for i in range(0, 3 * len(NAMES), len(NAMES))]
    assert all(sorted(e) == sorted(NAMES) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1, "each epoch draws a new permutation"
    other = [h["block"] for h in opt_steps(badam(Toy(), "random", seed=4),
                                           3 * len(NAMES) * SWITCH_EVERY)]
    assert other != seen


def opt_steps(opt, steps):
    model_params = [p for g in opt.param_groups for p in g["params"]]
    for _ in range(steps):
        for p in model_params:
            if p.requires_grad:
                p.grad = torch.ones_like(p)
        opt.step()
    return opt.history[:-1]


def test_flags_grads_and_state_follow_the_active_block():
    model = Toy()
    opt = badam(model, "descending")
    frozen = list(model.model.norm.parameters())
    for t in range(2 * len(NAMES) * SWITCH_EVERY):
        active = {id(p) for p in block_params(model, opt.active_block)}
        for p in model.parameters():
            assert p.requires_grad == (id(p) in active)
        model.loss(t).backward()
        assert all(p.grad is None for p in model.parameters() if id(p) not in active)
        assert all(p.grad is None for p in frozen)
        before = opt.active_block
        opt.step()
        if opt.active_block != before:
            # The new block's entries, empty until its first step.
            assert opt.state_bytes() == 0 and not any(opt.state.values())
            assert all(p.grad is None for p in block_params(model, before))
            assert not any(p.requires_grad for p in block_params(model, before))
        else:
            assert set(map(id, opt.state)) == active
            params = block_params(model, before)
            # The two fp32 moments and a float32 step count per tensor.
            assert opt.state_bytes() == 8 * sum(p.numel() for p in params) + 4 * len(params)
        opt.zero_grad()


def test_state_bytes_is_the_active_block_only():
    model = Toy(num_layers=4, width=16)
    opt = fk.BAdam(model, switch_every=2, switch_mode="ascending", **HYPER)
    everything = 8 * sum(p.numel() for p in model.parameters())
    model.loss(0).backward()
    opt.step()
    layer = list(model.model.layers[0].parameters())
    assert opt.state_bytes() == 8 * sum(p.numel() for p in layer) + 4 * len(layer) < everything / 4


def test_default_blocks_by_layer_index():
    names = [f"model.layers.{i}.mlp.weight" for i in range(12)] + ["model.embed_tokens.weight",
                                                                  "model.norm.weight"]
    named = [(n, nn.Parameter(torch.zeros(2))) for n in names]
    opt = fk.BAdam(named, switch_mode="ascending")
    assert opt.block_names == [f"model.layers.{i}" for i in range(12)]
    assert [len(g["params"]) for g in opt.param_groups] == [1] * 12
    assert opt.param_groups[1]["params"][0] is named[1][1]
    gpt2 = [(n, nn.Parameter(torch.zeros(2))) for n in
            ["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight",
             "transformer.h.0.ln_1.weight", "transformer.h.1.attn.c_attn.weight",
             "transformer.ln_f.weight"]]
    opt = fk.BAdam(gpt2, include_embedding=True)
    assert opt.block_names == ["embedding", "transformer.h.0", "transformer.h.1"]
    assert not gpt2[4][1].requires_grad


def test_frugal_kernels_model_names():
    from frugal_kernels.model import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=32, max_seq_len=16))
    opt = fk.BAdam(model, include_embedding=True, include_head=True)
    layers = [f"model.layers.{i}" for i in range(model.config.num_layers)]
    assert opt.block_names == ["embedding", *layers, "head"]


def test_blocks_by_names_and_patterns():
    model = Toy()
    opt = fk.BAdam(model, blocks={"first": ["model.layers.0.weight", r"model\.layers\.0\.bias"],
                                  "rest": [r"model\.layers\.[12]\..*", r"lm_head\..*"]},
                   switch_mode="fixed")
    assert opt.block_names == ["first", "rest"]
    assert [len(g["params"]) for g in opt.param_groups] == [2, 5]
    assert not model.model.embed_tokens.weight.requires_grad
    listed = fk.BAdam(Toy(), blocks=[[r"model\.layers\.0\..*"], [r"model\.layers\.1\..*"]])
    assert listed.block_names == ["block0", "block1"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(blocks={"a": ["no_such_param"]}), "matches no parameter"),
    (dict(blocks={"a": [r"model\.layers\.9\..*"]}), "matches no parameter"),
    (dict(blocks={"a": [r"model\.layers\.0\..*"], "b": ["model.layers.0.weight"]}),
     "in two blocks"),
    (dict(blocks={"a": [r"model\.layers\.0\..*"], "b": []}), "non-empty"),
    (dict(switch_every=0), "switch_every"),
    (dict(switch_every=2.5), "switch_every"),
    (dict(switch_mode="sideways"), "switch_mode"),
    (dict(switch_mode="fixed", order=["model.layers.7"]), "unknown block"),
    (dict(switch_mode="random", order=["model.layers.0"]), "order is for"),
    (dict(include_head=True, blocks={"a": ["lm_head.weight"]}), "include_embedding"),
])
def test_bad_input_raises_and_changes_nothing(kwargs, message):
    model = Toy()
    for p in model.model.layers[1].parameters():
        p.requires_grad_(False)
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        fk.BAdam(model, **kwargs)
    after = snapshot(model)
    for name, (value, flag) in before.items():
        assert torch.equal(after[name][0], value) and after[name][1] == flag, name


def run_steps(model, opt, start, stop):
    for t in range(start, stop):
        model.loss(t).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bit_identical(mode):
    steps, cut = 6 * SWITCH_EVERY + 2, 2 * SWITCH_EVERY + 1
    model = Toy()
    opt = badam(model, mode)
    run_steps(model, opt, 0, steps)

    first = Toy()
    opt1 = badam(first, mode)
    run_steps(first, opt1, 0, cut)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    resumed = Toy(seed=5)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = badam(resumed, mode)
    opt2.load_state_dict(checkpoint["opt"])
    assert opt2.active_block == opt1.active_block
    assert [p.requires_grad for p in resumed.parameters()] == \
        [p.requires_grad for p in first.parameters()]
    run_steps(resumed, opt2, cut, steps)
    assert opt2.history == opt.history
    assert len([h for h in opt2.history if h["step"] > cut]) >= 2
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_resume_after_a_skipped_step_keeps_the_count_of_applied_updates():
    """The bias-correction counts (each tensor's "step") travel in the state dict: a
    skipped step (found_inf) before the cut resumes exactly, and a count beyond the
    block's steps is refused."""
    model, first = Toy(), Toy()
    opt, opt1 = badam(model, "ascending"), badam(first, "ascending")
    for m, o in ((model, opt), (first, opt1)):
        run_steps(m, o, 0, 1)
        m.loss(1).backward()
        o.found_inf = torch.ones(())
        o.step()
        del o.found_inf
        o.zero_grad()
    saved = opt1.state_dict()
    assert saved["param_groups"][0]["badam"]["block_steps"] == 2
    assert saved["state"] and all(float(st["step"]) == 1.0 for st in saved["state"].values())
    resumed = copy.deepcopy(first)
    opt2 = badam(resumed, "ascending")
    opt2.load_state_dict(saved)
    run_steps(model, opt, 2, 2 * SWITCH_EVERY)
    run_steps(resumed, opt2, 2, 2 * SWITCH_EVERY)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    too_many = copy.deepcopy(saved)
    next(iter(too_many["state"].values()))["step"] = torch.tensor(3.0)
    with pytest.raises(ValueError, match="step count 3.0 is more than the block's steps"):
        badam(Toy(), "ascending").load_state_dict(too_many)


def test_format_3_block_updates():
    """Format 3 kept one count of the block's applied updates ("block_updates"): it
    becomes every tensor's step count; a state dict saved before it existed takes the
    block's step count, and a count beyond the block's steps is refused."""
    saved = torch.load(FIXTURES / "badam_format3.pt", weights_only=True)["adamw"]["opt"]
    extra = saved["param_groups"][0]["badam"]
    assert extra["version"] == 3 and extra["block_updates"] == extra["block_steps"] == 1
    older = copy.deepcopy(saved)
    del older["param_groups"][0]["badam"]["block_updates"]
    opt = badam(Toy(), "random")
    opt.load_state_dict(older)
    assert opt.state and all(float(st["step"]) == 1.0 for st in opt.state.values() if st)
    too_many = copy.deepcopy(saved)
    too_many["param_groups"][0]["badam"]["block_updates"] = 3.0
    with pytest.raises(ValueError, match="block_updates 3.0 is not a count"):
        badam(Toy(), "random").load_state_dict(too_many)


def test_bad_state_dict_raises_and_changes_nothing():
    model = Toy()
    opt = badam(model, "ascending")
    run_steps(model, opt, 0, SWITCH_EVERY + 1)
    good = opt.state_dict()
    other = Toy()
    target = badam(other, "ascending")
    run_steps(other, target, 0, 1)
    before, state_before = snapshot(other), target.state_dict()

    wrong_blocks = copy.deepcopy(good)
    wrong_blocks["param_groups"][0]["badam"]["block_names"][0] = "elsewhere"
    wrong_shape = copy.deepcopy(good)
    pid = next(iter(wrong_shape["state"]))
    wrong_shape["state"][pid]["exp_avg"] = torch.zeros(3)
    wrong_mode = copy.deepcopy(good)
    wrong_mode["param_groups"][0]["badam"]["switch_mode"] = "descending"
    wrong_order = copy.deepcopy(good)
    wrong_order["param_groups"][0]["badam"]["epoch"] = [0, 0, 1, 2, 3]
    cases = [(wrong_mode, "switch_mode"), (wrong_blocks, "blocks"),
             (wrong_shape, "shape"), (wrong_order, "block order"),
             ({"state": {}, "param_groups": []}, "not saved by BAdam")]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            target.load_state_dict(bad)
        after = snapshot(other)
        for name, (value, flag) in before.items():
            assert torch.equal(after[name][0], value) and after[name][1] == flag, name
        schedule = target.state_dict()["param_groups"][0]["badam"]
        schedule_before = state_before["param_groups"][0]["badam"]
        assert torch.equal(schedule.pop("generator"), schedule_before["generator"])
        assert schedule == {k: v for k, v in schedule_before.items() if k != "generator"}
        assert target.state_bytes() == 8 * other.model.embed_tokens.weight.numel() + 4
    target.load_state_dict(good)
    assert target.active_block == "model.layers.0" == opt.active_block


def test_bf16_master_copy():
    model = Toy().to(torch.bfloat16)
    opt = fk.BAdam(model, switch_every=2, switch_mode="ascending", **HYPER)
    active = list(model.model.layers[0].parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in active]
    ref = torch.optim.AdamW(masters, foreach=False, **HYPER)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=gen).bfloat16() for p in active]
        for p, m, g in zip(active, masters, grads):
            p.grad, m.grad = g.clone(), g.float()
        opt.step()
        ref.step()
        if opt.active_block == "model.layers.0":
            for p, m in zip(active, masters):
                st = opt.state[p]
                assert st["master"].dtype == torch.float32
                torch.testing.assert_close(st["master"], m.detach(), rtol=1e-6, atol=1e-7)
                assert torch.equal(p, st["master"].bfloat16())
            assert opt.state_bytes() == 12 * sum(p.numel() for p in active) + 4 * len(active)
    for p, m in zip(active, masters):
        assert torch.equal(p, m.detach().bfloat16())
    assert opt.state_bytes() == 0


def test_lr_scheduler_drives_every_block():
    model = Toy()
    opt = badam(model, "ascending")
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 2 else 1.0)
    for t in range(2):
        model.loss(t).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    assert all(g["lr"] == 0.0 for g in opt.param_groups)
    frozen = snapshot(model)
    run_steps(model, opt, 2, 3 * SWITCH_EVERY)
    # lr 0 also switches weight decay off: nothing moves, while the schedule goes on.
    for name, p in model.named_parameters():
        assert torch.equal(p, frozen[name][0]), name
    assert opt.active_block == "model.layers.2"


def test_grad_scaler_found_inf_skips_the_update_while_the_schedule_counts_the_call():
    """The skip is decided on the device: the block's params, moments and bias-correction
    count stay as they were, and the schedule counts the call (the host never reads
    found_inf; docs/optimizers.md, "Skipped steps and schedules")."""
    model = Toy()
    opt = badam(model, "ascending")
    model.loss(0).backward()
    before = snapshot(model)
    opt.found_inf = torch.ones(())
    for _ in range(SWITCH_EVERY - 1):
        opt.step()
    assert opt.active_block == "embedding"
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name][0]), name
    for st in opt.state.values():
        assert not st["exp_avg"].any() and not st["exp_avg_sq"].any()
    del opt.found_inf
    opt.grad_scale = torch.full((), 4.0)
    reference = copy.deepcopy(model)
    ref_opt = badam(reference, "ascending")  # a new optimizer clears the gradients
    for p, q in zip(model.parameters(), reference.parameters()):
        if p.grad is not None:
            q.grad = p.grad / 4.0
    opt.step()  # the block's first applied update: bias correction from step 1
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert opt.active_block == opt.block_names[1]  # SWITCH_EVERY calls: the switch


@pytest.mark.parametrize("inner", ["adamw", "frugal"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_policies(inner, value):
    """skip (default): the update is skipped and the call counted; raise: a ValueError
    naming the tensor, nothing changed, the call not counted; propagate: applied."""
    options = FRUGAL_INNER if inner == "frugal" else {}
    results = {}
    for policy in ("skip", "raise", "propagate"):
        model = Toy()
        opt = badam(model, "ascending", nonfinite=policy, **options)
        model.loss(0).backward()
        opt.step()
        opt.zero_grad()
        model.loss(1).backward()
        weight = model.model.embed_tokens.weight
        weight.grad.view(-1)[3] = value
        before = snapshot(model)
        steps = opt.state_dict()["param_groups"][0]["badam"]["steps_taken"]
        if policy == "raise":
            with pytest.raises(ValueError, match="non-finite gradient"):
                opt.step()
        else:
            opt.step()
        results[policy] = (all(torch.equal(p, before[n][0]) for n, p in model.named_parameters()),
                           opt.state_dict()["param_groups"][0]["badam"]["steps_taken"] - steps)
    assert results == {"skip": (True, 1), "raise": (True, 0), "propagate": (False, 1)}


def test_closure_and_governor():
    model = Toy()
    opt = badam(model, "ascending")

    def closure():
        opt.zero_grad()
        loss = model.loss(0)
        loss.backward()
        return loss

    assert isinstance(opt.step(closure), torch.Tensor)
    decision = Decision(action="reallocate", reason="test", evaluation=1, step=1, flops=0.0,
                        loss=1.0, remaining_flops=1.0, suggestion={"update_gap_factor": 1.5})
    opt.apply_governor(decision)
    assert opt.switch_every == 5 and "governor" in opt.history[-1]["reason"]
    opt.apply_governor(Decision(**{**decision.__dict__,
                                   "suggestion": {"switch_every_factor": 2.0,
                                                  "update_gap_factor": 9.0}}))
    assert opt.switch_every == 10
    with pytest.raises(ValueError, match="switch_every"):
        opt.switch_every = 0
    opt.switch_every = 1
    opt.step(closure)
    assert opt.active_block == "model.layers.0"


# ------------------------------------------------------------------ inner="frugal"

FRUGAL_INNER = dict(inner="frugal", density=0.5, projection="columns", update_gap=2)


def test_inner_frugal_at_density_one_is_the_adamw_inner():
    # FRUGAL with every coordinate state-full is AdamW: the same fused arithmetic,
    # so the same bits, switches and fresh moments per block included.
    steps = 4 * SWITCH_EVERY
    a, b = Toy(), Toy()
    opt_a = badam(a, "ascending")
    opt_b = badam(b, "ascending", inner="frugal", density=1.0, projection="columns")
    run_steps(a, opt_a, 0, steps)
    run_steps(b, opt_b, 0, steps)
    assert opt_a.history == opt_b.history
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_inner_frugal_matches_frugal_on_the_active_block():
    """Each block's run equals a FRUGAL built over that block alone (matrices projected,
    the rest AdamW) with the seed BAdam derives, the other parameters frozen."""
    from frugal_kernels.optim.badam import _inner_seed

    steps = 3 * SWITCH_EVERY
    model, ref = Toy(), Toy()
    opt = badam(model, "descending", seed=4, **FRUGAL_INNER)
    options = {k: v for k, v in FRUGAL_INNER.items() if k != "inner"}
    for t in range(steps):
        block = opt.active_block
        if t % SWITCH_EVERY == 0:
            active = train_only(ref, block)
            groups = [{"params": [p for p in active if p.dim() >= 2]},
                      {"params": [p for p in active if p.dim() < 2], "projected": False}]
            ref_opt = fk.FRUGAL([g for g in groups if g["params"]], seed=_inner_seed(4, t),
                                nonfinite="propagate", **options, **HYPER)
        for m, o in ((model, opt), (ref, ref_opt)):
            m.loss(t).backward()
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_inner_frugal_state_is_the_active_block_only_and_smaller():
    model = Toy(width=16)
    opt = badam(model, "ascending", **FRUGAL_INNER)
    run_steps(model, opt, 0, 1)
    active = block_params(model, opt.active_block)
    full = sum(2 * 4 * p.numel() for p in active)  # AdamW's two fp32 moments
    assert 0 < opt.state_bytes() < full
    run_steps(model, opt, 1, SWITCH_EVERY)  # the switch drops the block's FRUGAL
    assert opt.state_bytes() == 0


def test_inner_frugal_resumes_bit_identically():
    steps, cut = 4 * SWITCH_EVERY + 1, 2 * SWITCH_EVERY + 1
    model = Toy()
    opt = badam(model, "random", **FRUGAL_INNER)
    run_steps(model, opt, 0, steps)

    first = Toy()
    opt1 = badam(first, "random", **FRUGAL_INNER)
    run_steps(first, opt1, 0, cut)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed = Toy(seed=5)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = badam(resumed, "random", **FRUGAL_INNER)
    opt2.load_state_dict(checkpoint["opt"])
    assert opt2.state_bytes() == opt1.state_bytes() > 0
    run_steps(resumed, opt2, cut, steps)
    assert opt2.history == opt.history
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_inner_mismatch_in_a_state_dict_raises_and_changes_nothing():
    model = Toy()
    opt = badam(model, "ascending")
    run_steps(model, opt, 0, 1)
    other = badam(Toy(), "ascending", **FRUGAL_INNER)
    before = (other.state_dict()["param_groups"][0]["badam"]["steps_taken"], other.state_bytes())
    with pytest.raises(ValueError, match="inner='adamw'"):
        other.load_state_dict(opt.state_dict())
    assert (other.state_dict()["param_groups"][0]["badam"]["steps_taken"], other.state_bytes()) == before


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(inner="lion"), ValueError, "inner must be one of"),
    (dict(density=0.5), ValueError, "options of inner='frugal'"),
    (dict(inner="frugal", rho=0.5), TypeError, "unexpected keyword"),
    (dict(inner="frugal", density=1.5), ValueError, "density"),
    (dict(inner="frugal", projection="diagonal"), ValueError, "projection"),
])
def test_bad_inner_options_raise_and_change_nothing(kwargs, error, message):
    model = Toy()
    before = snapshot(model)
    with pytest.raises(error, match=message):
        fk.BAdam(model, **kwargs)
    after = snapshot(model)
    for name, (value, flag) in before.items():
        assert torch.equal(after[name][0], value) and after[name][1] == flag, name


def test_inner_frugal_state_is_saved_under_the_model_parameters():
    """FRUGAL's per-tensor state of the active block is BAdam's own, keyed by the block's
    parameters (torch.distributed.checkpoint keys them by name): the subsets and their
    compact moments for the matrices, AdamW's moments for the rest; saving it changes
    nothing."""
    model = Toy()
    opt = badam(model, "random", **FRUGAL_INNER)
    run_steps(model, opt, 0, SWITCH_EVERY + 1)
    bytes_before = opt.state_bytes()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["badam"]["version"] == 4
    block = opt.param_groups[opt.active_block_index]
    ids = sd["param_groups"][opt.active_block_index]["params"]
    assert set(sd["state"]) == set(ids)
    for p, pid in zip(block["params"], ids):
        st = sd["state"][pid]
        if p.dim() >= 2:
            k = round(FRUGAL_INNER["density"] * p.shape[-1])
            assert st.keys() == {"exp_avg", "exp_avg_sq", "step", "indices"}
            assert st["exp_avg"].shape == (p.shape[0], k) == st["exp_avg_sq"].shape
        else:
            assert st.keys() == {"exp_avg", "exp_avg_sq", "step"}
            assert st["exp_avg"].shape == p.shape
    assert opt.state_bytes() == bytes_before


def test_inner_frugal_loads_the_format_2_layout():
    """Format 2 kept the nested FRUGAL's per-tensor state inside "inner_state" (keyed by
    its own ids: the active block's trained matrices first, then the rest): the format 3
    fixture rewritten so resumes as exactly."""
    saved = copy.deepcopy(torch.load(FIXTURES / "badam_format3.pt", weights_only=True)["frugal"])
    sd = saved["opt"]
    extra = sd["param_groups"][0]["badam"]
    active = extra["epoch"][extra["cursor"]]
    ids = sd["param_groups"][active]["params"]
    dims = [p.dim() for p in block_params(Toy(), extra["block_names"][active])]
    order = [pid for pid, d in zip(ids, dims) if d >= 2] + \
            [pid for pid, d in zip(ids, dims) if d < 2]
    inner_ids = [pid for g in extra["inner_state"]["param_groups"] for pid in g["params"]]
    old_state = {}
    for pid, inner_pid in zip(order, inner_ids):
        st = sd["state"].get(pid, {})
        old_state[inner_pid] = {k[len("inner_"):]: st.pop(k) for k in list(st)
                                if k.startswith("inner_")}
    assert any(old_state.values())
    extra["inner_state"] = {**extra["inner_state"], "state": old_state}
    extra["version"] = 2
    _resumes_exactly(saved, FRUGAL_INNER, torch.float32)


# ------------------------------------------------------------ the engine's guarantees

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("case", ["adamw", "adamw_bf16", "frugal"])
def test_a_checkpoint_of_format_3_resumes_exactly(case):
    """State dicts written by the BAdam of main at f2ab600 (format 3: inner="adamw" with
    fp32 and bf16 params, inner="frugal"), 2 * SWITCH_EVERY + 1 steps into a "random"
    run, saved with the model: loaded into today's BAdam, the run goes on as one that
    never stopped."""
    saved = torch.load(FIXTURES / "badam_format3.pt", weights_only=True)[case]
    _resumes_exactly(saved, FRUGAL_INNER if case == "frugal" else {},
                     torch.bfloat16 if case == "adamw_bf16" else torch.float32)


def _resumes_exactly(saved, options, dtype):
    """A "random" run resumed from ``saved`` (its model, optimizer state and cut) goes on
    as one that never stopped: the same block schedule, and parameters equal to the
    uninterrupted run's within a few ulps. Not bit-equal: the fixture was written on
    another CPU, whose GEMMs round the embedding's and head's gradients one ulp apart from
    this one's (bit-exact resume on one machine is test_resume_is_bit_identical's); a load
    that dropped or misplaced a moment moves the next steps by about lr, far beyond it."""
    steps = saved["cut"] + 2 * SWITCH_EVERY
    model = Toy().to(dtype)
    opt = badam(model, "random", **options)
    run_steps(model, opt, 0, steps)
    resumed = Toy(seed=5).to(dtype)
    resumed.load_state_dict(saved["model"])
    opt2 = badam(resumed, "random", **options)
    opt2.load_state_dict(saved["opt"])
    run_steps(resumed, opt2, saved["cut"], steps)
    assert opt2.history == opt.history
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("inner", ["adamw", "frugal"])
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(lr=torch.tensor(-0.1)), ValueError, "lr must be finite and >= 0"),
    (dict(lr=float("inf")), ValueError, "lr must be finite and >= 0"),
    (dict(lr=torch.tensor(float("inf"))), ValueError, "lr must be finite and >= 0"),
    (dict(eps=float("inf")), ValueError, "eps must be finite and >= 0"),
    (dict(eps=float("nan")), ValueError, "eps must be finite and >= 0"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay must be finite and >= 0"),
    (dict(betas=(0.9, 1.0)), ValueError, r"betas must be in \[0, 1\)"),
    (dict(betas=0.9), ValueError, "betas must be a pair"),
    (dict(lr="0.1"), TypeError, "lr must be a number"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(backend="gpu"), ValueError, "backend must be"),
])
def test_options_are_checked_as_frugal_checks_them(inner, kwargs, error, message):
    """BAdam refuses at construction what FRUGAL refuses, with FRUGAL's message, and
    changes nothing (no flag of the model)."""
    options = dict(HYPER, **kwargs)
    with pytest.raises(error, match=message):
        fk.FRUGAL(Toy().parameters(), **{k: v for k, v in options.items()
                                         if k in ("lr", "betas", "eps", "weight_decay",
                                                  "seed", "backend")})
    model = Toy()
    before = snapshot(model)
    with pytest.raises(error, match=message):
        fk.BAdam(model, **options, **(FRUGAL_INNER if inner == "frugal" else {}))
    after = snapshot(model)
    for name, (value, flag) in before.items():
        assert torch.equal(after[name][0], value) and after[name][1] == flag, name


def _badam_state(opt):
    """The schedule's counts and the per-tensor state (with the step counts)."""
    sd = opt.state_dict()
    extra = sd["param_groups"][0]["badam"]
    return (extra["steps_taken"], extra["block_steps"],
            {pid: {k: v.clone() for k, v in st.items()} for pid, st in sd["state"].items()})


def _assert_same_state(a, b):
    assert a[:2] == b[:2]
    assert a[2].keys() == b[2].keys()
    for pid, st in a[2].items():
        assert st.keys() == b[2][pid].keys()
        for key, value in st.items():
            assert torch.equal(value, b[2][pid][key]), (pid, key)


@pytest.mark.parametrize("inner", ["adamw", "frugal"])
@pytest.mark.parametrize("fault", ["lr", "grad_dtype", "sparse"])
def test_a_step_that_raises_changes_nothing(inner, fault):
    """A step refused for a bad lr set between steps, or a gradient of another dtype in
    the block's second dtype, or a sparse gradient, advances neither the schedule nor
    the bias-correction count and updates no tensor of the block (one of two dtypes)."""
    model = Toy()
    model.model.layers[0].bias.data = model.model.layers[0].bias.data.bfloat16()
    opt = fk.BAdam(model, switch_mode="ascending", switch_every=SWITCH_EVERY, **HYPER,
                   **(FRUGAL_INNER if inner == "frugal" else {}))
    layer = model.model.layers[0]

    def grads():
        layer.weight.grad = torch.ones_like(layer.weight)
        layer.bias.grad = torch.ones_like(layer.bias)

    grads()
    opt.step()
    grads()
    before, params = _badam_state(opt), snapshot(model)
    if fault == "lr":
        opt.param_groups[0]["lr"] = -1.0
        error, message = ValueError, "lr must be finite and >= 0"
    elif fault == "grad_dtype":
        layer.bias.grad = None
        layer.bias.grad_dtype = None  # let autograd's dtype check go, as a user might
        layer.bias.grad = torch.ones(layer.bias.shape, dtype=torch.float32)
        error, message = ValueError, "gradient of dtype"
    else:
        layer.bias.grad = torch.ones_like(layer.bias).to_sparse()
        error, message = ValueError, "sparse gradient"
    for _ in range(SWITCH_EVERY):  # enough calls for a switch, had they counted
        with pytest.raises(error, match=message):
            opt.step()
    _assert_same_state(_badam_state(opt), before)
    assert opt.active_block == "model.layers.0" and len(opt.history) == 1
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name][0]), name


@pytest.mark.parametrize("inner", ["adamw", "frugal"])
def test_the_users_frozen_parameters_stay_frozen(inner):
    """A parameter the user froze (requires_grad=False) inside a block is never turned
    back on nor trained, through switches and a resume; the rest of its block trains."""
    model = Toy()
    bias = model.model.layers[0].bias
    bias.requires_grad_(False)
    opt = fk.BAdam(model, switch_mode="ascending", switch_every=2, **HYPER,
                   **(FRUGAL_INNER if inner == "frugal" else {}))
    frozen = bias.detach().clone()
    weight = model.model.layers[0].weight.detach().clone()
    for t in range(3 * 2 + 1):  # a full pass over the 3 blocks and back to the first
        assert not bias.requires_grad
        model.loss(t).backward()
        opt.step()
        opt.zero_grad()
    assert opt.active_block == "model.layers.0"
    assert torch.equal(bias, frozen) and not torch.equal(model.model.layers[0].weight, weight)
    resumed = copy.deepcopy(model)
    opt2 = fk.BAdam(resumed, switch_mode="ascending", switch_every=2, **HYPER,
                    **(FRUGAL_INNER if inner == "frugal" else {}))
    resumed.model.layers[0].bias.requires_grad_(True)  # the flags are the optimizer's now
    opt2.load_state_dict(opt.state_dict())
    assert not resumed.model.layers[0].bias.requires_grad
    assert resumed.model.layers[0].weight.requires_grad


@pytest.mark.parametrize("key", ["epoch", "cursor", "steps_taken", "block_steps",
                                 "switch_every", "generator", "history"])
def test_a_state_dict_missing_an_entry_is_refused_and_changes_nothing(key):
    model = Toy()
    opt = badam(model, "ascending")
    run_steps(model, opt, 0, SWITCH_EVERY + 1)
    sd = opt.state_dict()
    del sd["param_groups"][0]["badam"][key]
    other = Toy()
    target = badam(other, "ascending")
    run_steps(other, target, 0, 1)
    before = _badam_state(target)
    with pytest.raises(ValueError, match=f"'badam' entry lacks {key}"):
        target.load_state_dict(sd)
    _assert_same_state(_badam_state(target), before)


@pytest.mark.parametrize("key, value, message", [
    ("steps_taken", -7, "steps_taken must be an int >= 0"),
    ("steps_taken", 2.5, "steps_taken must be an int"),
    ("block_steps", -1, "block_steps must be an int >= 0"),
    ("block_steps", 10**6, "block_steps 1000000 is more than steps_taken"),
    ("cursor", "0", "cursor must be an int"),
    ("switch_every", 0, "switch_every"),
    ("generator", torch.zeros(3, dtype=torch.uint8), "generator state cannot be restored"),
    ("history", [[["step", 0]], 7], "history is not a list of lists"),
])
def test_a_state_dict_with_a_bad_count_is_refused_and_changes_nothing(key, value, message):
    model = Toy()
    opt = badam(model, "ascending")
    run_steps(model, opt, 0, SWITCH_EVERY + 1)
    sd = opt.state_dict()
    sd["param_groups"][0]["badam"][key] = value
    other = Toy()
    target = badam(other, "ascending")
    run_steps(other, target, 0, 1)
    before, flags = _badam_state(target), snapshot(other)
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(sd)
    _assert_same_state(_badam_state(target), before)
    after = snapshot(other)
    for name, (value, flag) in flags.items():
        assert torch.equal(after[name][0], value) and after[name][1] == flag, name


@pytest.mark.parametrize("make", ["FRUGAL", "BAdam"])
def test_a_parameter_of_a_dtype_the_ops_do_not_take_is_refused_at_construction(make):
    """A float64 parameter beside float32 ones was refused by the op at the step, after
    the float32 tensors had been updated: now at construction, with nothing changed."""
    model = Toy()
    model.model.layers[0].bias.data = model.model.layers[0].bias.data.double()
    before = snapshot(model)
    with pytest.raises(TypeError, match="float32, bfloat16 and float16 parameters"):
        if make == "FRUGAL":
            fk.FRUGAL(model.parameters(), **HYPER)
        else:
            fk.BAdam(model, **HYPER)
    after = snapshot(model)
    for name, (value, flag) in before.items():
        assert torch.equal(after[name][0], value) and after[name][1] == flag, name


def test_a_second_badam_over_the_same_model_trains_every_block():
    """The blocks a first BAdam froze are not the user's frozen parameters: a BAdam built
    afterwards over the same model trains each of its blocks in turn (the user's own
    frozen bias stays frozen)."""
    model = Toy()
    model.model.layers[0].bias.requires_grad_(False)
    run_steps(model, badam(model, "ascending"), 0, SWITCH_EVERY + 1)
    opt = fk.BAdam(model, switch_mode="ascending", switch_every=1, **HYPER)
    start = snapshot(model)
    run_steps(model, opt, 0, 3)
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, start[name][0])}
    assert moved == {"model.layers.0.weight", "model.layers.1.weight", "model.layers.1.bias",
                     "model.layers.2.weight", "model.layers.2.bias"}


@pytest.mark.parametrize("inner", ["adamw", "frugal"])
def test_clip_grad_norm_then_step_equals_torchs_clip_then_step(inner):
    """BAdam has the engine's clip_grad_norm_: the norm of the active block's gradients,
    the clip applied inside the next step, equal to torch's clip of the gradients
    followed by the step, through block switches (the two norms' sums may differ in
    the last bit; tests/optim/test_clip.py takes torch's factor from our norm and finds
    the same bits)."""
    options = FRUGAL_INNER if inner == "frugal" else {}
    a, b = Toy(), Toy()
    opt_a, opt_b = badam(a, "random", **options), badam(b, "random", **options)
    for t in range(3 * SWITCH_EVERY + 1):
        a.loss(t).backward()
        norm = opt_a.clip_grad_norm_(0.1)
        opt_a.step()
        opt_a.zero_grad()
        b.loss(t).backward()
        expected = torch.nn.utils.clip_grad_norm_(
            [p for p in b.parameters() if p.grad is not None], 0.1)
        opt_b.step()
        opt_b.zero_grad()
        assert float(norm) == pytest.approx(float(expected), rel=1e-6)
        assert float(norm) > 0.1  # the clip bites
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=(t, name))
    assert opt_a.history == opt_b.history and len(opt_a.history) == 4


@pytest.mark.parametrize("key, value, message", [
    ("inner_steps", -1, "inner_steps must be an int >= 0"),
    ("inner_last_change", 0, "inner_last_change must be an int >= 1"),
    ("inner_generator", torch.zeros(3, dtype=torch.uint8), "inner generator state cannot"),
    ("inner_record", [["active", [7]], ["cursor", 0]], "not sorted unique ids of the block's"),
    ("inner_record", 3, "inner_record is not a list"),
])
def test_a_bad_inner_schedule_is_refused_and_changes_nothing(key, value, message):
    """inner="frugal"'s schedule in the "badam" entry is checked before anything changes."""
    blocks = dict(FRUGAL_INNER, projection="blocks")
    model = Toy()
    opt = badam(model, "ascending", **blocks)
    run_steps(model, opt, 0, 1)
    sd = opt.state_dict()
    sd["param_groups"][0]["badam"][key] = value
    other = Toy()
    target = badam(other, "ascending", **blocks)
    run_steps(other, target, 0, 1)
    before, flags = _badam_state(target), snapshot(other)
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(sd)
    _assert_same_state(_badam_state(target), before)
    assert target.state_dict()["param_groups"][0]["badam"]["inner_steps"] == 1
    after = snapshot(other)
    for name, (value, flag) in flags.items():
        assert torch.equal(after[name][0], value) and after[name][1] == flag, name
