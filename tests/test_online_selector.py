"""data.OnlineSelector: a fixed-seed selection equals a for-loop over full logits, ties are
broken by the seeded generator, and a resumed selector continues as an uninterrupted one."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from frugal_kernels.data import BigramReference, OnlineSelector, sequence_scores
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM


def _model(seed=0):
    return LlamaForCausalLM(LlamaConfig.from_preset("tiny", max_seq_len=12), seed=seed)


def _batch(b=8, seed=1):
    ids = torch.randint(0, 256, (b, 12), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, 6:] = -100
    return ids, labels


def _loop_scores(model, ids, labels, kind):
    """Each sequence alone, from its full logits."""
    out = []
    with torch.no_grad():
        for i in range(ids.shape[0]):
            z = model(ids[i:i + 1]).logits[0, :-1]
            y = labels[i, 1:]
            kept = y != -100
            if kind == "loss":
                per = F.cross_entropy(z, y, ignore_index=-100, reduction="none")
            else:
                p = torch.softmax(z, dim=-1)
                p[kept, y[kept]] -= 1
                per = p.norm(dim=-1) * kept
            out.append(per.sum() / kept.sum())
    return torch.stack(out)


@pytest.mark.parametrize("kind", ["loss", "el2n"])
def test_sequence_scores_equal_a_loop_over_full_logits(kind):
    model, (ids, labels) = _model(), _batch()
    got = sequence_scores(model, ids, labels, kind)
    assert torch.allclose(got, _loop_scores(model, ids, labels, kind), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["loss", "el2n", "rho"])
def test_a_fixed_seed_selection_equals_the_for_loop_reference(policy):
    model, (ids, labels) = _model(), _batch()
    reference = _model(seed=5)
    selector = OnlineSelector(policy, keep=0.375, reference=reference, seed=3)
    picked_ids, picked_labels, kept = selector.select(model, ids, labels)
    s = _loop_scores(model, ids, labels, "el2n" if policy == "el2n" else "loss")
    if policy == "rho":
        s = s - _loop_scores(reference, ids, labels, "loss")
    expected = sorted(sorted(range(8), key=lambda i: -float(s[i]))[:3])
    assert kept.tolist() == expected
    assert torch.equal(picked_ids, ids[kept]) and torch.equal(picked_labels, labels[kept])
    assert selector.scored_tokens == ids.numel()
    assert selector.scoring_flops(10.0, 4.0) == ids.numel() * (14.0 if policy == "rho" else 10.0)


def test_ties_follow_the_seed_and_a_resumed_selector_continues_exactly():
    """Equal scores: the choice is the generator's alone. Three calls, a checkpoint, two
    more, against a selector resumed from the checkpoint."""
    scores = torch.zeros(10)
    whole = OnlineSelector("loss", keep=0.5, seed=7)
    first = [whole.choose(scores).tolist() for _ in range(3)]
    state = copy.deepcopy(whole.state_dict())
    rest = [whole.choose(scores).tolist() for _ in range(2)]
    resumed = OnlineSelector("loss", keep=0.5, seed=123)
    resumed.load_state_dict(state)
    assert [resumed.choose(scores).tolist() for _ in range(2)] == rest
    again = OnlineSelector("loss", keep=0.5, seed=7)
    assert [again.choose(scores).tolist() for _ in range(3)] == first
    assert len({tuple(c) for c in first + rest}) > 1  # the order is random, not fixed


def test_bad_settings_are_refused():
    for kwargs, match in ((dict(policy="entropy"), "policy must be one of"),
                          (dict(keep=0.0), "keep must be in"), (dict(keep=1.5), "keep must be in"),
                          (dict(candidates=0), "candidates must be an int"),
                          (dict(policy="rho"), "needs a reference model")):
        with pytest.raises(ValueError, match=match):
            OnlineSelector(**kwargs)
    with pytest.raises(ValueError, match="not 'loss', 0.5"):
        OnlineSelector("loss", 0.5).load_state_dict(OnlineSelector("el2n", 0.5).state_dict())


def _bigram_loop(fit_ids, ids, labels, smoothing):
    """The mean log p(label | byte before) of each row, from pair counts in plain Python."""
    counts = [[0] * 256 for _ in range(256)]
    for row in fit_ids.tolist():
        for a, b in zip(row, row[1:]):
            counts[a][b] += 1
    scores = []
    for row, lab in zip(ids.tolist(), labels.tolist()):
        total, n = 0.0, 0
        for a, b in zip(row, lab[1:]):
            if b != -100:
                total += math.log((counts[a][b] + smoothing) / (sum(counts[a]) + 256 * smoothing))
                n += 1
        scores.append(total / n)
    return torch.tensor(scores)


def _text_batch():
    """Rows of a repeated phrase beside rows of random bytes: the bigram tells them apart."""
    g = torch.Generator().manual_seed(2)
    text = torch.tensor(list(b"def f(x):\n    return x + 1\n" * 4))
    rows = [text[s:s + 12] for s in torch.randint(0, 80, (5,), generator=g).tolist()]
    rows += list(torch.randint(0, 256, (3, 12), generator=g))
    order = torch.randperm(8, generator=g)
    ids = torch.stack(rows)[order]
    labels = ids.clone()
    labels[1, 7:] = -100
    return ids, labels, text[None], (order < 5).nonzero().flatten().tolist()


def test_a_fixed_seed_ngram_selection_equals_the_for_loop_reference():
    ids, labels, fit, text_rows = _text_batch()
    reference = BigramReference(smoothing=0.5).fit(fit)
    got = reference.sequence_scores(ids, labels)
    expected = _bigram_loop(fit, ids, labels, 0.5)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
    selector = OnlineSelector("ngram", keep=0.5, reference=reference, seed=3)
    _, _, kept = selector.select(_Unused(), ids, labels)
    assert kept.tolist() == sorted(sorted(range(8), key=lambda i: -float(expected[i]))[:4])
    # the random rows have no bigram structure: none is kept
    assert set(kept.tolist()) <= set(text_rows)
    assert selector.scored_tokens == ids.numel()
    assert selector.scoring_flops(1e6) == ids.numel() * BigramReference.FLOPS_PER_TOKEN


def test_a_fixed_seed_middle_selection_equals_the_for_loop_reference():
    model, (ids, labels) = _model(), _batch()
    selector = OnlineSelector("middle", keep=0.375, seed=3)
    _, _, kept = selector.select(model, ids, labels)
    s = _loop_scores(model, ids, labels, "loss")
    ranked = sorted(range(8), key=lambda i: -float(s[i]))
    # 5 dropped: the 3 highest losses and the 2 lowest
    assert kept.tolist() == sorted(ranked[3:6])
    assert selector.scored_tokens == ids.numel()


class _Unused(torch.nn.Module):
    """A model that must not be run: ngram and random score without it."""

    def forward(self, *args, **kwargs):
        raise AssertionError("the model was run")


def test_a_fixed_seed_random_selection_is_the_generators_draw():
    ids, labels = _batch(b=10)
    selector = OnlineSelector("random", keep=0.3, seed=5)
    draws = [selector.select(_Unused(), ids, labels)[2].tolist() for _ in range(4)]
    generator = torch.Generator().manual_seed(5)
    assert draws == [sorted(torch.randperm(10, generator=generator)[:3].tolist())
                     for _ in range(4)]
    assert len({tuple(d) for d in draws}) > 1
    assert selector.scored_tokens == 0 and selector.scoring_flops(1e6) == 0


@pytest.mark.parametrize("policy", ["middle", "ngram", "random"])
def test_a_resumed_selector_of_each_new_policy_continues_exactly(policy):
    _, _, fit, _ = _text_batch()
    scores = torch.tensor([1.0, 1.0, 2.0, 0.5, 1.0, 1.0, 3.0, 1.0])

    def make(seed):
        return OnlineSelector(policy, keep=0.5, seed=seed,
                              reference=BigramReference().fit(fit) if policy == "ngram"
                              else None)

    whole = make(7)
    [whole.choose(scores) for _ in range(3)]
    state = copy.deepcopy(whole.state_dict())
    rest = [whole.choose(scores).tolist() for _ in range(3)]
    resumed = make(99)
    resumed.load_state_dict(state)
    assert [resumed.choose(scores).tolist() for _ in range(3)] == rest


def test_the_bigram_reference_round_trips_its_state():
    ids, labels, fit, _ = _text_batch()
    reference = BigramReference(smoothing=0.25).fit(fit)
    other = BigramReference()
    other.load_state_dict(reference.state_dict())
    assert torch.equal(other.sequence_scores(ids, labels), reference.sequence_scores(ids, labels))


@pytest.mark.parametrize("policy, reference, match", [
    ("ngram", None, "BigramReference"), ("rho", None, "reference model"),
    ("best", None, "policy must be one of")])
def test_a_policy_without_its_reference_is_refused(policy, reference, match):
    with pytest.raises(ValueError, match=match):
        OnlineSelector(policy, reference=reference)
