"""The optimizer table: one :class:`OptimizerInfo` per optimizer configuration,
in the style of PyTorch's OptimizerInfo.

An entry builds its own model (parameters, or a module for optimizers that take
one, as BAdam will) and a fresh optimizer over it; the contract tests of
tests/optim/test_contract.py run every entry (exact resume through
``torch.load(weights_only=True)``, LR schedulers, closures, GradScaler,
torch.compile, state dicts that do not fit, add_param_group, groups without
gradients). BAdam and DQT have their entries. A DQT weight's values are its
layer's codes, not the placeholder parameter: the tests read what a step
changes through :func:`values`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import frugal_kernels as fk
from frugal_kernels.nn import QuantLinear, QuantWeight
from frugal_kernels.optim.subspace_choice import PROJECTIONS

from .optim.helpers import HYPER, groups, make_params, set_grads

# What an optimizer is built from (param groups, named parameters or a module)
# and the parameters it updates, in a fixed order for gradients and comparisons.
Model = Tuple[Any, List[torch.nn.Parameter]]


@dataclass(frozen=True)
class Misfit:
    """A change that makes a saved state dict not fit the optimizer: loading it
    raises a ValueError matching ``message`` and changes nothing."""

    name: str
    mutate: Callable[[dict], Any]
    message: str


@dataclass(frozen=True)
class OptimizerInfo:
    name: str
    make_model: Callable[[int], Model]                  # seed -> (inputs, params)
    factory: Callable[..., torch.optim.Optimizer]       # factory(inputs, **options)
    # Option sets the resume test runs under (name -> options).
    variants: Dict[str, dict] = field(default_factory=lambda: {"default": {}})
    # Called after each step of a training loop: the loss-aware schedules watch a loss.
    after_step: Optional[Callable[[torch.optim.Optimizer, int], None]] = None
    # Public attributes an exact resume must give back.
    resumed_attributes: Tuple[str, ...] = ()
    misfits: Tuple[Misfit, ...] = ()
    # torch.compile of step(): the graphs it may make (None: not compiled here)
    # and options that keep the graph count stable.
    compile_graphs: Optional[int] = None
    compile_options: dict = field(default_factory=dict)
    # The params a step just taken moved (None: all of them). BAdam moves its
    # active block only.
    trained: Optional[Callable[[torch.optim.Optimizer], List[torch.nn.Parameter]]] = None
    # Optimizers whose groups are fixed refuse add_param_group with a ValueError
    # matching this (None: a new group is accepted and stepped).
    add_param_group_refused: Optional[str] = None
    # Options a step in backward (frugal_kernels.step_in_backward) needs: the default
    # nonfinite="skip" needs every gradient before the first update.
    in_backward_options: dict = field(default_factory=dict)

    def moved(self, opt, params) -> List[torch.nn.Parameter]:
        return list(params) if self.trained is None else list(self.trained(opt))

    def build(self, seed: int = 0, **options) -> Tuple[torch.optim.Optimizer, list]:
        inputs, params = self.make_model(seed)
        return self.factory(inputs, **options), params

    def train(self, opt, params, grad_seq: Sequence[Sequence[torch.Tensor]], start: int = 0):
        """One step per gradient list (with this entry's per-step hook)."""
        for t, grads in enumerate(grad_seq, start=start):
            set_grads(params, grads)
            opt.step()
            if self.after_step is not None:
                self.after_step(opt, t)


def values(params, clone: bool = False) -> List[torch.Tensor]:
    """The tensors that hold ``params``' values: a QuantWeight's are its layer's packed
    codes, every other parameter's its own data."""
    out = [p.codes if isinstance(p, QuantWeight) else p.detach() for p in params]
    return [v.clone() for v in out] if clone else out


def _grouped_params(seed: int) -> Model:
    proj, reg = make_params(seed=seed)
    return groups(proj, reg), proj + reg


def _frugal(projection: str):
    def factory(inputs, **options):
        return fk.FRUGAL(inputs, **{**HYPER, "density": 0.3, "update_gap": 3,
                                    "projection": projection, "seed": 5, **options})
    return factory


def _adafrugal(projection: str):
    def factory(inputs, **options):
        return fk.AdaFRUGAL(inputs, **{**HYPER, "rho_start": 0.5, "rho_end": 0.1,
                                       "rho_steps": 10, "update_gap": 2, "update_gap_max": 6,
                                       "projection": projection, "seed": 5, **options})
    return factory


def _observe_flat_loss(opt, t: int) -> None:
    opt.observe_loss(1.0 + 0.001 * (t % 2))  # flat: T grows on the way


def _frugal_misfits(projection: str) -> Tuple[Misfit, ...]:
    """State dicts of the FRUGAL family that do not fit (state[0] is a regular
    parameter's AdamW state, which every projection keeps)."""
    other = "rows" if projection != "rows" else "columns"
    return (
        Misfit("no frugal entry", lambda sd: sd["param_groups"][0].pop("frugal"),
               "not saved by a FRUGAL optimizer"),
        Misfit("fewer groups", lambda sd: sd["param_groups"].pop(), "1 param groups"),
        Misfit("fewer params", lambda sd: sd["param_groups"][1]["params"].pop(),
               "params but the state dict"),
        Misfit("other projection", lambda sd: sd["param_groups"][1].update(projection=other),
               f"projection is '{projection}'"),
        Misfit("state shape", lambda sd: sd["state"][0].update(exp_avg=torch.zeros(3, 3),
                                                               exp_avg_sq=torch.zeros(3, 3)),
               "does not fit"),
        Misfit("state dtype",
               lambda sd: sd["state"][0].update(exp_avg=sd["state"][0]["exp_avg"].double()),
               "exp_avg has dtype"),
        Misfit("unknown entry", lambda sd: sd["state"][0].update(projector="a Python object"),
               "unknown entry"),
    )


_RESET_VARIANTS = {"reset_state": {"reset_state": True}, "keep_state": {"reset_state": False}}
_IN_BACKWARD = {"nonfinite": "raise"}
_RESUMED = ("history", "update_gap", "rho")

# torch.compile makes one graph of FRUGAL's step for every projection: subspace
# changes of the coordinate and low-rank projections keep the graph; with blocks a
# change to tensors of other shapes than an earlier choice's compiles again (the
# parameters here all differ; tests/optim/test_compile.py has equal ones), so that
# entry compiles with changes too rare to happen.
_COMPILE_OPTIONS = {"blocks": {"update_gap": 100}}

OPTIMIZERS = (
    *(OptimizerInfo(
        name=f"FRUGAL-{projection}", make_model=_grouped_params, factory=_frugal(projection),
        variants=_RESET_VARIANTS, resumed_attributes=_RESUMED,
        misfits=_frugal_misfits(projection),
        compile_graphs=1, compile_options=_COMPILE_OPTIONS.get(projection, {}),
        in_backward_options=_IN_BACKWARD,
    ) for projection in PROJECTIONS),
    *(OptimizerInfo(
        name=f"AdaFRUGAL-{projection}", make_model=_grouped_params,
        factory=_adafrugal(projection), variants=_RESET_VARIANTS, after_step=_observe_flat_loss,
        resumed_attributes=_RESUMED, misfits=_frugal_misfits(projection),
        # A shrinking density reshapes the moments: one more graph (a static
        # rho keeps one). One projection is enough: the graphs are FRUGAL's.
        compile_graphs=2 if projection == "columns" else None,
        in_backward_options=_IN_BACKWARD,
    ) for projection in PROJECTIONS),
)


def _int8_params(seed: int) -> Model:
    """Projected matrices of 8-bit moments (two of them with a partial block in each row),
    one too small for them, and an unprojected group with an embedding-like matrix (8-bit
    moments) beside 1-D tensors (fp32 moments)."""
    proj, reg = make_params(seed=seed, projected=[(64, 80), (80, 300), (16, 16), (3, 40, 50)],
                            regular=[(40,), (7,), (70, 64)])
    return groups(proj, reg), proj + reg


def _other_state_dtype(sd: dict) -> None:
    for group in sd["param_groups"]:
        group["state_dtype"] = "fp32"


def _frugal_int8(projection: str):
    def factory(inputs, **options):
        return _frugal(projection)(inputs, state_dtype="int8", **options)
    return factory


# FRUGAL with 8-bit moments (state_dtype="int8"): the whole-tensor AdamW state of blocks
# and of the unprojected group through ops.adamw_int8_, the rows and columns subsets'
# compact state through ops.frugal_step_int8_.
OPTIMIZERS = OPTIMIZERS + tuple(
    OptimizerInfo(
        name=f"FRUGAL-{projection}-int8", make_model=_int8_params,
        factory=_frugal_int8(projection),
        variants=_RESET_VARIANTS, resumed_attributes=_RESUMED,
        misfits=_frugal_misfits(projection) + (
            Misfit("other state_dtype", _other_state_dtype, "state_dtype='fp32'"),),
        compile_graphs=1, compile_options=_COMPILE_OPTIONS.get(projection, {}),
        in_backward_options=_IN_BACKWARD,
    ) for projection in ("blocks", "rows", "columns"))


def _layered_model(seed: int) -> Model:
    """Three transformer-like layers (BAdam's default blocks) of a matrix and a vector."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for _ in range(3):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(6, 5, generator=gen))
        layer.bias = torch.nn.Parameter(torch.randn(6, generator=gen))
        model.layers.append(layer)
    return model, list(model.parameters())


def _badam(mode: str, **fixed):
    def factory(model, **options):
        return fk.BAdam(model, **{**HYPER, "switch_every": 2, "switch_mode": mode, "seed": 5,
                                  **fixed, **options})
    return factory


OPTIMIZERS = OPTIMIZERS + tuple(
    OptimizerInfo(name=f"BAdam-{mode}", make_model=_layered_model, factory=_badam(mode),
                  resumed_attributes=("history", "active_block"),
                  trained=lambda opt: opt.param_groups[opt.active_block_index]["params"],
                  add_param_group_refused="param groups are its blocks",
                  in_backward_options=_IN_BACKWARD)
    for mode in ("random", "ascending", "descending", "fixed")) + (
    OptimizerInfo(name="BAdam-frugal", make_model=_layered_model,
                  factory=_badam("random", inner="frugal", density=0.5, projection="columns",
                                 update_gap=3),
                  resumed_attributes=("history", "active_block"),
                  trained=lambda opt: opt.param_groups[opt.active_block_index]["params"],
                  add_param_group_refused="param groups are its blocks",
                  in_backward_options=_IN_BACKWARD),
)


def _int8_layered_model(seed: int) -> Model:
    """Three layers (BAdam's default blocks), each of a matrix large enough for 8-bit moments
    (a partial block in each row), a small matrix and a bias (fp32 moments)."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for _ in range(3):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(64, 80, generator=gen))
        layer.small = torch.nn.Parameter(torch.randn(6, 5, generator=gen))
        layer.bias = torch.nn.Parameter(torch.randn(64, generator=gen))
        model.layers.append(layer)
    return model, list(model.parameters())


# BAdam with 8-bit moments (state_dtype="int8"): the active block's AdamW state, and
# inner="frugal"'s whole-tensor state (projection="blocks") through ops.adamw_int8_ or its
# columns subsets' state through ops.frugal_step_int8_.
OPTIMIZERS = OPTIMIZERS + tuple(
    OptimizerInfo(name=name, make_model=_int8_layered_model,
                  factory=_badam("random", state_dtype="int8", **inner),
                  resumed_attributes=("history", "active_block"),
                  misfits=(Misfit("other state_dtype", _other_state_dtype,
                                  "state_dtype='fp32'"),),
                  trained=lambda opt: opt.param_groups[opt.active_block_index]["params"],
                  add_param_group_refused="param groups are its blocks",
                  in_backward_options=_IN_BACKWARD)
    for name, inner in (("BAdam-int8", {}),
                        ("BAdam-frugal-int8", dict(inner="frugal", density=0.5,
                                                   projection="blocks", update_gap=3)),
                        ("BAdam-frugal-columns-int8", dict(inner="frugal", density=0.5,
                                                           projection="columns",
                                                           update_gap=3))))


def _quant_model(seed: int) -> Model:
    """Three QuantLinear layers (4 bits per-row scales, 3 bits, ternary) and their biases.
    The scales do not depend on ``seed`` (the step never changes them), so that two
    models differ in what :func:`values` reads."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers = [QuantLinear(10, 12, bits=4, scale="row", seed=1),
                  QuantLinear(12, 9, bits=3, seed=2),
                  QuantLinear(9, 6, bias=False, bits=2, seed=3)]
    for layer in layers:
        layer.scale.fill_(0.05)
    quant = [layer.weight for layer in layers]
    reg = [layer.bias for layer in layers if layer.bias is not None]
    return groups(quant, reg), reg + quant


def _dqt(update: str, projection: str = "columns"):
    def factory(inputs, **options):
        return fk.DQT(inputs, **{**HYPER, "update": update, "projection": projection,
                                 "density": 0.4, "update_gap": 3, "seed": 5, **options})
    return factory


OPTIMIZERS = OPTIMIZERS + tuple(
    OptimizerInfo(name=f"DQT-{update}", make_model=_quant_model, factory=_dqt(update),
                  misfits=_frugal_misfits("columns")[:2], in_backward_options=_IN_BACKWARD)
    for update in ("adamw", "sign")) + tuple(
    OptimizerInfo(name=f"DQT-frugal-{projection}", make_model=_quant_model,
                  factory=_dqt("frugal", projection), variants=_RESET_VARIANTS,
                  resumed_attributes=_RESUMED, misfits=_frugal_misfits(projection),
                  in_backward_options=_IN_BACKWARD)
    for projection in ("blocks", "columns", "rows", "randk"))
