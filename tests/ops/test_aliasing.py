"""A call in which a tensor the op writes shares memory with another tensor of the call
is refused before anything is written, on every backend."""

import pytest
import torch

from frugal_kernels import ops

from .helpers import cpu_backends

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=2)


def _tensors():
    gen = torch.Generator().manual_seed(0)
    p = [torch.randn(6, 5, generator=gen), torch.randn(7, generator=gen)]
    g = [torch.randn(6, 5, generator=gen), torch.randn(7, generator=gen)]
    m = [torch.zeros(6, 5), torch.zeros(7)]
    v = [torch.ones(6, 5), torch.ones(7)]
    return p, g, m, v


def _adamw(p, g, m, v, backend):
    ops.adamw_(p, g, m, v, backend=backend, **HYPER)


def _sign_sgd(p, g, m, v, backend):
    ops.sign_sgd_(p, g, lr=1e-2, backend=backend)


def _sgd(p, g, m, v, backend):
    ops.sgd_(p, g, m, lr=1e-2, momentum=0.9, backend=backend)


def _frugal_step(p, g, m, v, backend):
    idx = [torch.arange(p[0].shape[0], dtype=torch.int32), torch.arange(7, dtype=torch.int32)]
    ops.frugal_step_(p, g, m, v, idx, kind="rows", backend=backend, **HYPER)


# (op, how the call is made to alias): each case writes in place through a tensor
# that another argument also names.
ALIASES = {
    "grad is the param": lambda p, g, m, v: (p, [p[0], g[1]], m, v),
    "a param twice": lambda p, g, m, v: ([p[0], p[0]], [g[0], g[0]],
                                         [m[0], torch.zeros(6, 5)], [v[0], torch.ones(6, 5)]),
    "exp_avg is exp_avg_sq": lambda p, g, m, v: (p, g, m, [m[0], v[1]]),
    "overlapping views": lambda p, g, m, v: (
        [p[0][:3], p[0].view(-1)[10:24].view(2, 7)], [g[0][:3], g[0].view(-1)[:14].view(2, 7)],
        [m[0][:3], m[0].view(-1)[15:29].view(2, 7)], [v[0][:3], v[0].view(-1)[15:29].view(2, 7)]),
}
OPS = {"adamw_": (_adamw, ALIASES),
       "sign_sgd_": (_sign_sgd, {k: ALIASES[k] for k in ("grad is the param", "a param twice")}),
       "sgd_": (_sgd, {k: ALIASES[k] for k in ("grad is the param", "a param twice")}),
       "frugal_step_": (_frugal_step, {k: ALIASES[k] for k in ("grad is the param",
                                                                "exp_avg is exp_avg_sq")})}


def _rows():
    for name, (call, aliases) in OPS.items():
        for backend in cpu_backends("frugal::" + name):
            for alias in aliases:
                yield pytest.param(name, alias, backend.values[0], marks=backend.marks,
                                   id=f"{name}-{alias}-{backend.id}")


@pytest.mark.parametrize("op,alias,backend", list(_rows()))
def test_aliased_call_raises_and_changes_nothing(op, alias, backend):
    call, aliases = OPS[op]
    p, g, m, v = aliases[alias](*_tensors())
    everything = {id(t): t for t in [*p, *g, *m, *v]}
    before = {k: t.clone() for k, t in everything.items()}
    with pytest.raises(ValueError, match="shares memory"):
        call(p, g, m, v, backend)
    for k, t in everything.items():
        assert torch.equal(t, before[k])


def test_disjoint_views_of_one_buffer_are_accepted():
    p, g, m, v = _tensors()
    flat = torch.randn(60)
    params = [flat[:30].view(6, 5), flat[30:37]]
    ops.adamw_(params, g, m, v, **HYPER)
    assert not torch.equal(flat[:37], torch.zeros(37))
