"""Fixtures of the optimizer tests: parameters, gradient sequences and a loop reference."""

from __future__ import annotations

import io
from typing import Dict, List, Sequence

import torch

PROJECTED_SHAPES = [(24, 40), (40, 24), (16, 16), (3, 4, 10)]
REGULAR_SHAPES = [(40,), (7,)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def make_params(seed: int = 0, dtype=torch.float32, projected=PROJECTED_SHAPES,
                regular=REGULAR_SHAPES):
    gen = torch.Generator().manual_seed(seed)
    proj = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in projected]
    reg = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in regular]
    return proj, reg


def groups(proj, reg, **projected_options):
    return [{"params": reg, "projected": False},
            {"params": proj, "projected": True, **projected_options}]


def grad_sequence(params: Sequence[torch.Tensor], steps: int, seed: int = 1) -> List[List[torch.Tensor]]:
    """Gradients that do not depend on the parameters, so trajectories of two
    implementations cannot drift apart through the loss."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
            for _ in range(steps)]


def set_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


def run(opt, params, grads_seq, after_step=None) -> None:
    for t, grads in enumerate(grads_seq, start=1):
        set_grads(params, grads)
        opt.step()
        if after_step is not None:
            after_step(t)


def roundtrip(sd):
    """``sd`` through torch.save and torch.load(weights_only=True), as a checkpoint goes."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same(a, b, where="state_dict"):
    """Equal nested state: tensors bit for bit, everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class LoopReference:
    """An independent FRUGAL step written with plain torch ops, one tensor at a
    time, in textbook AdamW form, with DENSE moments masked by the state-full
    set (the package keeps compact moments). It takes the subspace the
    optimizer chose (a mask, or a projection) as data."""

    def __init__(self, params, lr, betas, eps, weight_decay, state_free="sign", scale=1.0):
        self.p = [t.detach().clone().double() for t in params]
        self.m: Dict[int, torch.Tensor] = {}
        self.v: Dict[int, torch.Tensor] = {}
        self.t: Dict[int, int] = {}
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.state_free, self.scale = state_free, scale

    def reset(self, i: int, shape) -> None:
        self.m[i] = torch.zeros(shape, dtype=torch.float64)
        self.v[i] = torch.zeros(shape, dtype=torch.float64)
        self.t[i] = 0

    def keep_only(self, i: int, mask: torch.Tensor) -> None:
        """reset_state=False: moments survive only where the coordinate stays state-full."""
        self.m[i] = self.m[i] * mask
        self.v[i] = self.v[i] * mask

    def _adam_update(self, i: int, g: torch.Tensor) -> torch.Tensor:
        self.t[i] += 1
        self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
        self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
        m_hat = self.m[i] / (1 - self.b1 ** self.t[i])
        v_hat = self.v[i] / (1 - self.b2 ** self.t[i])
        return -self.lr * m_hat / (v_hat.sqrt() + self.eps)

    def _free_update(self, g: torch.Tensor) -> torch.Tensor:
        if self.state_free == "sign":
            return -self.lr * self.scale * torch.sign(g)
        if self.state_free == "sgd":
            return -self.lr * self.scale * g
        return torch.zeros_like(g)

    def adamw(self, i: int, g: torch.Tensor) -> None:
        g = g.double()
        if i not in self.m:
            self.reset(i, g.shape)
        self.p[i] = self.p[i] * (1 - self.lr * self.wd) + self._adam_update(i, g)

    def masked(self, i: int, g: torch.Tensor, mask: torch.Tensor) -> None:
        """Coordinates in `mask` get AdamW (moments kept dense, zero elsewhere)."""
        g = g.double()
        if i not in self.m:
            self.reset(i, g.shape)
        adam = self._adam_update(i, g * mask)
        self.m[i] = self.m[i] * mask
        self.v[i] = self.v[i] * mask
        update = torch.where(mask, adam, self._free_update(g))
        self.p[i] = self.p[i] * (1 - self.lr * self.wd) + update

    def lowrank(self, i: int, g: torch.Tensor, proj: torch.Tensor, right: bool,
                full_rank: bool) -> None:
        g2 = g.double().reshape(g.shape[0], -1)
        P = proj.double()
        low = g2 @ P.t() if right else P.t() @ g2
        if i not in self.m:
            self.reset(i, low.shape)
        up = (lambda x: x @ P) if right else (lambda x: P @ x)
        update = up(self._adam_update(i, low))
        if not full_rank:
            update = update + self._free_update(g2 - up(low))
        new = self.p[i].reshape(g2.shape) * (1 - self.lr * self.wd) + update
        self.p[i] = new.reshape(g.shape)

    def state_free_only(self, i: int, g: torch.Tensor) -> None:
        g = g.double()
        self.p[i] = self.p[i] * (1 - self.lr * self.wd) + self._free_update(g)


def changed_at(opt, t: int) -> bool:
    return any(h["step"] == t and h["reason"] in ("initial", "update_gap") for h in opt.history)


def mask_of(p: torch.Tensor, indices: torch.Tensor, subset_kind: str) -> torch.Tensor:
    mask = torch.zeros(p.shape, dtype=torch.bool)
    idx = indices.long().cpu()
    if subset_kind == "rows":
        mask[idx] = True
    elif subset_kind == "columns":
        mask[..., idx] = True
    else:
        mask.view(-1)[idx] = True
    return mask
