"""The surface a training loop reads from an optimizer (frugal_kernels.FrugalOptimizer) and
its view over a plain torch.optim optimizer (frugal_kernels.protocol_of)."""

import ast
from pathlib import Path

import pytest
import torch

import frugal_kernels as fk
from frugal_kernels.optim.memory import storage_bytes

from ..optim_db import OPTIMIZERS
from .helpers import grad_sequence, set_grads

PACKAGE = Path(fk.__file__).resolve().parent
# The loops and benchmarks that read optimizers: through the protocol, never by probing.
READERS = [PACKAGE / "lab", PACKAGE / "bench"]


@pytest.mark.parametrize("info", [pytest.param(i, id=i.name) for i in OPTIMIZERS[::4]])
def test_every_optimizer_of_the_package_is_its_own_surface(info):
    opt, params = info.build()
    set_grads(params, grad_sequence(params, 1)[0])
    opt.step()
    assert isinstance(opt, fk.FrugalOptimizer) and fk.protocol_of(opt) is opt
    assert opt.state_bytes() > 0 and isinstance(opt.history, list)
    info_values = opt.training_info()
    if isinstance(opt, fk.FRUGAL):
        assert opt.state_bytes() == storage_bytes(
            v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        assert info_values == {"rho": opt.rho, "update_gap": opt.update_gap}
    else:
        assert info_values == {}
    assert opt.governable == isinstance(opt, (fk.AdaFRUGAL, fk.BAdam))


def test_a_plain_torch_optimizer_gets_the_defaults():
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=1e-2)
    surface = fk.protocol_of(opt)
    assert surface.state_bytes() == 0 and surface.history == []
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    opt.step()
    # exp_avg, exp_avg_sq and a float32 step per parameter.
    assert surface.state_bytes() == sum(2 * 4 * p.numel() + 4 for p in params)
    assert surface.training_info() == {} and not surface.governable
    surface.observe_loss(1.0)  # nothing listens: no error, nothing changes
    with pytest.raises(TypeError, match="AdamW has no schedule that a governor can reallocate"):
        surface.apply_governor(None)
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    total = surface.clip_grad_norm_(1.0)
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params])),
        torch.tensor(1.0), atol=1e-5, rtol=0)


def test_a_swapped_optimizers_clip_is_its_own_fused_one():
    params = [torch.nn.Parameter(torch.randn(5, 3))]
    params[0].grad = torch.full_like(params[0], 3.0)
    grad = params[0].grad.clone()
    twin = [torch.nn.Parameter(params[0].detach().clone())]
    twin[0].grad = grad.clone()
    opt = fk.swap(torch.optim.AdamW(params, lr=1e-2))
    reference = torch.optim.AdamW(twin, lr=1e-2)
    total = fk.protocol_of(opt).clip_grad_norm_(1.0)
    torch.testing.assert_close(total, torch.linalg.vector_norm(grad))
    # The fused clip leaves the gradient as it was and applies the factor inside the step.
    assert torch.equal(params[0].grad, grad)
    opt.step()
    torch.nn.utils.clip_grad_norm_(twin, 1.0)
    reference.step()
    torch.testing.assert_close(params[0], twin[0])


def test_a_fused_optimizer_that_ignores_losses_and_the_governor_says_so():
    opt = fk.FRUGAL([torch.nn.Parameter(torch.randn(6, 4))], update_gap=3)
    before = opt.training_info()
    opt.observe_loss(2.0)
    assert opt.training_info() == before and opt.history == []
    with pytest.raises(TypeError, match="FRUGAL has no schedule"):
        opt.apply_governor(None)


def _probes(path: Path):
    """hasattr / getattr / callable(getattr(...)) calls on a name that holds an optimizer."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr") and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in ("opt", "optimizer", "inner")):
            yield f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


def test_the_training_app_and_the_bench_read_optimizers_through_the_protocol():
    probes = [hit for folder in READERS for path in sorted(folder.rglob("*.py"))
              for hit in _probes(path)]
    assert probes == []
