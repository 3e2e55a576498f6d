"""A steady-state step never reads a tensor on the host, and a skipped step changes nothing.

A steady-state step is one between subspace changes (no new subspace, block or
plan). On a GPU, reading a device tensor on the host (``.item()``, ``bool``,
``float``, ``int``, ``.tolist()``, ``.cpu()``, ``.numpy()``) waits for the
device: a sync, which also forbids CUDA graphs. On the CPU a sync cannot be
seen, so these tests forbid what would cause one: any of those conversions made
by the optimizer layer during the step. The ops read their own host scalars
(``lr`` and ``step`` living on the CPU, a CPU ``found_inf``) in their backends;
on a GPU the cuda and triton kernels read device tensors on the device instead
(tests/ops/test_grad_scaler.py), so a conversion whose nearest frame of the
package is under ``frugal_kernels/ops``, ``frugal_kernels/kernels`` or
``frugal_kernels/reference.py`` is allowed.

Every optimizer of tests/optim_db.py is stepped with ``nonfinite="skip"`` (the
default) and with a GradScaler's tensors (``grad_scale`` / ``found_inf``, as
``scaler.step`` sets them), and so are the swapped torch optimizers. A NaN, +inf
or -inf in one coordinate of one gradient must leave every param, state tensor
and step count bit-identical, decided without a host read.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Iterator, List

import pytest
import torch

import frugal_kernels as fk

from ..optim_db import OPTIMIZERS, OptimizerInfo, values
from .helpers import HYPER, grad_sequence, groups, make_params, set_grads

_PACKAGE = os.path.dirname(os.path.abspath(fk.__file__)) + os.sep
# Where the ops read their own host scalars (see the module docstring).
_OPS_LAYER = tuple(os.path.join(_PACKAGE, part) for part in
                   ("ops" + os.sep, "kernels" + os.sep, "reference.py"))
_CONVERSIONS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu",
                "numpy")
SCALE = 1024.0  # a power of two, as GradScaler's


@contextlib.contextmanager
def no_host_reads() -> Iterator[List[str]]:
    """Make every tensor-to-host conversion by the optimizer layer raise (and record it)."""
    originals = {name: getattr(torch.Tensor, name) for name in _CONVERSIONS}
    seen: List[str] = []

    def guarded(name):
        original = originals[name]

        def conversion(self, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                path = frame.f_code.co_filename
                if path.startswith(_PACKAGE):
                    if path.startswith(_OPS_LAYER):
                        break
                    where = (f"Tensor.{name} from {os.path.relpath(path, _PACKAGE)}:"
                             f"{frame.f_lineno} ({frame.f_code.co_name})")
                    seen.append(where)
                    raise AssertionError(f"a host read in a steady-state step: {where}")
                frame = frame.f_back
            return original(self, *args, **kwargs)

        return conversion

    try:
        for name in _CONVERSIONS:
            setattr(torch.Tensor, name, guarded(name))
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def test_the_guard_catches_a_host_read_in_the_optimizer_layer():
    from frugal_kernels.optim import engine
    flag = torch.ones(1)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with no_host_reads() as seen:
        with pytest.raises(AssertionError, match="a host read in a steady-state step"):
            engine.first_nonfinite([(0, 0, p)])
        assert bool(flag)  # the test's own reads are not the optimizer's
    assert len(seen) == 1 and "optim/engine.py" in seen[0]


# ------------------------------------------------------------------ the optimizers

def _steady_options(info: OptimizerInfo) -> dict:
    """Options that keep every step after the first between subspace changes."""
    if info.name.startswith("BAdam"):
        return {"switch_every": 1000, **({"update_gap": 1000} if "frugal" in info.name else {})}
    if info.name.startswith("AdaFRUGAL"):
        return {"update_gap": 1000, "update_gap_max": 1000}
    return {"update_gap": 1000}


def _swapped(cls, fused: bool, **options):
    def make_model(seed: int):
        proj, reg = make_params(seed=seed)
        return groups(proj, reg), proj + reg

    def factory(inputs, **_):
        inputs = [{k: v for k, v in g.items() if k != "projected"} for g in inputs]
        return fk.swap(cls(inputs, fused=fused, **options))

    name = f"swap-{cls.__name__}{'-fused' if fused else ''}"
    return OptimizerInfo(name, make_model, factory)


SWAPPED = (
    _swapped(torch.optim.AdamW, True, **HYPER),
    _swapped(torch.optim.AdamW, False, **HYPER),
    _swapped(torch.optim.Adam, True, lr=1e-2, weight_decay=0.1),
    _swapped(torch.optim.SGD, True, lr=1e-2, momentum=0.9, weight_decay=0.1),
)
OWN = [pytest.param(info, id=info.name) for info in OPTIMIZERS]
ALL = OWN + [pytest.param(info, id=info.name) for info in SWAPPED]


def _steady(info: OptimizerInfo, warmup: int = 2):
    """An optimizer past its first steps (the plan built, the op calls checked once)."""
    opt, params = info.build(**({} if info in SWAPPED else _steady_options(info)))
    for grads in grad_sequence(params, warmup, seed=3):
        set_grads(params, grads)
        opt.step()
    return opt, params


def _state_tensors(opt) -> dict:
    """Every tensor of the optimizer's state (the step counts too), keyed by where it
    lives, cloned."""
    out = {}
    index = {id(p): (gi, i) for gi, g in enumerate(opt.param_groups)
             for i, p in enumerate(g["params"])}
    for p, st in opt.state.items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                out[("state", index[id(p)], key)] = value.clone()
    return out


def _assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(value, after[key]), f"{key} changed at a skipped step"


def _moved(opt, params, before) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(values(params), before))


@pytest.mark.parametrize("info", ALL)
def test_a_steady_state_step_reads_nothing_on_the_host(info):
    opt, params = _steady(info)
    set_grads(params, grad_sequence(params, 1, seed=8)[0])
    before = values(params, clone=True)
    with no_host_reads():
        opt.step()
    assert _moved(opt, params, before)


@pytest.mark.parametrize("info", ALL)
@pytest.mark.parametrize("found", [0.0, 1.0])
def test_a_step_with_a_grad_scalers_tensors_reads_nothing_on_the_host(info, found):
    """As ``scaler.step`` drives it: gradients scaled, ``grad_scale`` and ``found_inf``
    set. found_inf = 0 takes the step on the unscaled gradients; 1 changes nothing."""
    opt, params = _steady(info)
    twin, twin_params = _steady(info)
    grads = grad_sequence(params, 1, seed=8)[0]
    set_grads(params, [g * SCALE for g in grads])
    if found:
        params[0].grad.view(-1)[0] = math.inf  # what found_inf says
    opt.grad_scale, opt.found_inf = torch.tensor(SCALE), torch.tensor(found)
    before, state = values(params, clone=True), _state_tensors(opt)
    with no_host_reads():
        opt.step()
    del opt.grad_scale, opt.found_inf
    if found:
        assert all(torch.equal(a, b) for a, b in zip(values(params), before))
        _assert_unchanged(state, _state_tensors(opt))
        return
    set_grads(twin_params, grads)
    twin.step()
    assert _moved(opt, params, before)
    for a, b in zip(values(params), values(twin_params)):
        assert torch.equal(a, b)


def _targets(opt, info, params) -> List[int]:
    """Where a bad coordinate goes: the first and last tensors the step trains (a
    projected and a regular tensor of FRUGAL's groups, a bias and a quantized weight
    of DQT's, two tensors of BAdam's active block)."""
    trained = {id(p) for p in info.moved(opt, params)}
    at = [i for i, p in enumerate(params) if id(p) in trained]
    return [at[0], at[-1]]


@pytest.mark.parametrize("info", ALL)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("which", [0, 1], ids=["first", "last"])
def test_a_nonfinite_gradient_skips_the_step_on_the_device(info, value, which):
    opt, params = _steady(info)
    # A swapped torch optimizer takes the same default (swap(..., nonfinite="skip")).
    assert info in SWAPPED or opt.nonfinite == "skip"
    grads = grad_sequence(params, 1, seed=8)[0]
    at = _targets(opt, info, params)[which]
    grads[at].view(-1)[grads[at].numel() // 2] = value
    set_grads(params, grads)
    before, state = values(params, clone=True), _state_tensors(opt)
    with no_host_reads():
        opt.step()
    for i, (a, b) in enumerate(zip(values(params), before)):
        assert torch.equal(a, b), f"params[{i}] moved at a skipped step"
    _assert_unchanged(state, _state_tensors(opt))
    # The next finite step is applied, from the counts of the applied steps: as a twin
    # that never saw the bad step (the schedules are far from a change here). DQT's
    # stochastic rounding counts calls of step() (docs/optimizers.md): its twin is
    # skipped at the same call by a found_inf instead.
    twin, twin_params = _steady(info)
    if getattr(twin, "_draws_random_numbers", False):
        set_grads(twin_params, grads)
        twin.found_inf = torch.ones(())
        twin.step()
        del twin.found_inf
    finite = grad_sequence(params, 1, seed=9)[0]
    for o, ps in ((opt, params), (twin, twin_params)):
        set_grads(ps, finite)
        o.step()
    for a, b in zip(values(params), values(twin_params)):
        assert torch.equal(a, b)
    _assert_unchanged(_state_tensors(twin), _state_tensors(opt))


def test_the_step_counts_hold_the_applied_steps():
    """Counted before the update and taken back after it when skipped: never advanced by
    a skipped step, and the bias correction of the next one is the applied count's."""
    info = next(i for i in OPTIMIZERS if i.name == "FRUGAL-columns")
    opt, params = _steady(info)
    steps = {float(st["step"]) for st in opt.state.values() if "step" in st}
    assert steps == {2.0}
    for t in range(3):
        grads = grad_sequence(params, 1, seed=10 + t)[0]
        grads[-1].view(-1)[0] = math.nan
        set_grads(params, grads)
        opt.step()
    assert {float(st["step"]) for st in opt.state.values() if "step" in st} == {2.0}
    set_grads(params, grad_sequence(params, 1, seed=20)[0])
    opt.step()
    assert {float(st["step"]) for st in opt.state.values() if "step" in st} == {3.0}
