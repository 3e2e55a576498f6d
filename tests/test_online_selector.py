"""data.OnlineSelector: a fixed-seed selection equals a for-loop over full logits, ties are
broken by the seeded generator, and a resumed selector continues as an uninterrupted one."""

import copy

import pytest
import torch
import torch.nn.functional as F

from frugal_kernels.data import OnlineSelector, sequence_scores
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
