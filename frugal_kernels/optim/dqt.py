"""DQT: training weights stored as packed INT-n codes, with no float master copy.

Each step of a :class:`frugal_kernels.nn.QuantLinear` weight is one fused
``dqt_update_`` call per bucket: dequantize, the update (AdamW, SignSGD or the
FRUGAL split), stochastic rounding back to the codes, pack. The other
parameters (embeddings, norms, biases, the output head) get AdamW. DQT is
FRUGAL's optimizer with a family that routes the quantized weights to the dqt
rules, so the subspace schedule, checkpoints and checks are FRUGAL's.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from frugal_kernels import _quant
from frugal_kernels._shard import RowShard, is_sharded, local
from frugal_kernels.nn import QuantWeight
from frugal_kernels.optim import sharding
from frugal_kernels.optim.frugal import FRUGAL
from frugal_kernels.optim.plan import STATE_FREE, Assignment
from frugal_kernels.optim.projections import DENSE, FAMILIES, Projection, Subspace

__all__ = ["DQT", "UPDATES"]

UPDATES = ("adamw", "sign", "frugal")
# The FRUGAL projections a quantized weight can take: its codes are updated
# elementwise, which a low-rank projection (a GEMM on the float weight) is not.
QUANT_PROJECTIONS = ("blocks", "columns", "rows", "randk")
# Those whose draw is the same on a block of a weight's rows as on the whole weight:
# the columns (every row's), and whole tensors.
SHARDED_PROJECTIONS = ("columns", "blocks")


def _quantized(p: Tensor) -> bool:
    """Whether ``p`` is a quantized weight (under FSDP2, a DTensor of QuantWeight blocks)."""
    return isinstance(local(p), QuantWeight)


class _StateFreeOnly(Projection):
    """No coordinate state-full: the state-free rule only, and no state."""

    def choose(self, sub: Subspace) -> None:
        for p in sub.group["params"]:
            sub.state[p].clear()

    def assign(self, sub: Subspace, i: int, p: Tensor) -> Assignment:
        return STATE_FREE

    def fits(self, saved: dict, p: Tensor) -> bool:
        return False


class QuantFamily(Projection):
    """A param group under DQT: its QuantWeights take ``inner``'s split of their
    codes (as the dqt rules), every other tensor plain AdamW."""

    def __init__(self, inner: Projection):
        self.inner = inner
        self.state_keys = inner.state_keys

    @staticmethod
    def _quantized(sub: Subspace) -> Subspace:
        params = [p for p in sub.group["params"] if _quantized(p)]
        return dataclasses.replace(sub, group={**sub.group, "params": params})

    def choose(self, sub: Subspace) -> None:
        self.inner.choose(self._quantized(sub))

    def assign(self, sub: Subspace, i: int, p: Tensor) -> Assignment:
        if not _quantized(p):
            return DENSE.assign(sub, i, p)
        # The inner family sees the group's quantized weights alone (its records,
        # the active blocks, count among them).
        j = sum(map(_quantized, sub.group["params"][:i]))
        inner = self.inner.assign(self._quantized(sub), j, p)
        rule = {"adamw": "dqt_adamw", "state_free": "dqt_state_free",
                "subset": "dqt_subset"}[inner.rule]
        return Assignment(rule, subset_kind=inner.subset_kind, index_dtype=inner.index_dtype,
                          bits=local(p).bits)

    def fits(self, saved: dict, p: Tensor) -> bool:
        return (self.inner if _quantized(p) else DENSE).fits(saved, p)

    # Under fully_shard the global form of a quantized weight's state is the inner
    # family's (a column subset's moments are [rows, k], not the weight's shape).

    def global_state(self, st: dict, p: Tensor, layout: RowShard) -> dict:
        return (self.inner if _quantized(p) else DENSE).global_state(st, p, layout)

    def local_state(self, saved: dict, p: Tensor, layout: RowShard,
                    device: torch.device) -> dict:
        return (self.inner if _quantized(p) else DENSE).local_state(saved, p, layout, device)

    def check_saved(self, saved: dict, p: Tensor) -> Optional[str]:
        if _quantized(p):
            return self.inner.check_saved(saved, p)
        if any(k in saved for k in self.state_keys):
            return f"{', '.join(k for k in self.state_keys if k in saved)} for a tensor that " \
                   "is not quantized (it takes plain AdamW)"
        return None


_QUANT_FAMILIES: Dict[str, QuantFamily] = {
    "adamw": QuantFamily(DENSE),
    "sign": QuantFamily(_StateFreeOnly()),
    **{name: QuantFamily(FAMILIES[name]) for name in QUANT_PROJECTIONS},
}


class DQT(FRUGAL):
    r"""Direct quantized training: the weights of :class:`frugal_kernels.nn.QuantLinear`
    layers are updated in their INT-n codes, with stochastic rounding.

    For a quantized weight ``W = s q`` (codes ``q`` in ``-qmax .. qmax``, scale
    ``s``, see :mod:`frugal_kernels._quant`), a step computes the update ``u``
    of the chosen rule on the dequantized weight and writes back

    .. math::
        q \leftarrow \operatorname{clamp}\Big(\operatorname{SR}\big(
            (s q (1 - \gamma\lambda) - \gamma u) / s\big), -q_{max}, q_{max}\Big)

    where SR rounds up with probability equal to the fractional part (so the
    expected weight is the exact update while it stays in range), drawing its
    numbers from a counter-based generator keyed by the layer's seed, the
    step count and the element's index: every backend, thread count and a
    resumed run write the same codes. The scales do not change.

    ``update`` chooses ``u`` for the quantized weights:

    - ``"adamw"``: AdamW with fp32 moments of the weight's shape (8 bytes per
      weight of state);
    - ``"sign"``: SignSGD, ``u = state_free_lr_scale * sign(g)``, no state;
    - ``"frugal"``: FRUGAL's split: AdamW with compact moments on a state-full
      fraction ``density`` of the rows, columns or coordinates
      (``projection`` ``"rows"``, ``"columns"``, ``"randk"``) or of the whole
      tensors (``"blocks"``), chosen again every ``update_gap`` steps, and the
      ``state_free`` rule on the rest. The low-rank projections (``random``,
      ``svd``) are refused: they update the float weight through GEMMs.

    Every other parameter (embeddings, norms, biases, a head left in full
    precision) gets AdamW with the group's options. A group with
    ``"projected": False`` gives its quantized weights ``"adamw"``. Groups may
    set ``update``, ``projection``, ``density`` and the FRUGAL options of their
    own.

    Args:
        params: parameters or param groups (``model.parameters()`` of a model
            converted by :func:`frugal_kernels.quantize_`, say).
        bits: ``None`` reads each weight's width from its layer; an int asks
            that every quantized weight has it (ValueError otherwise).
        lr, betas, eps, weight_decay, density, update_gap, projection,
        state_free, state_free_lr_scale, reset_state, block_order, seed,
        backend, nonfinite: as for :class:`frugal_kernels.FRUGAL`.
        state_dtype: ``"fp32"`` only: ``"int8"`` raises a ValueError. The quantized
            weights' AdamW moments are read and written inside ``dqt_update_``'s
            fused pass, which takes fp32 moments; 8-bit moments there need a
            variant of that op (codes and block scales, as ``adamw_int8_`` takes),
            which does not exist yet.

    Under DDP every rank steps the whole weights with the averaged gradient and
    writes the same codes. Under FSDP2 (``fully_shard``, or the deprecated
    :func:`frugal_kernels.nn.shard_quantized_`) each rank holds a block of every
    layer's rows: the state is kept for those rows (saved as DTensors of the whole
    weight's rows), the rounding keys each element by its index in the whole weight,
    and ``update="frugal"`` takes ``projection`` ``"columns"`` or ``"blocks"`` (the
    row-wise draws are refused).

    The codes take ``bits / 8`` bytes per weight; the weight gradient has the
    dtype of the layer's ``dtype`` (bf16: 2 bytes per weight). Under
    ``torch.compile`` the step runs eagerly: its op takes the step count of
    the random numbers as a Python int, which a graph would specialise on.

    Example::

        frugal_kernels.quantize_(model, bits=4)
        opt = frugal_kernels.DQT(model.parameters(), lr=1e-3, update="frugal",
                                 density=0.25, projection="columns")
    """

    _subclass_params = (QuantWeight,)
    _draws_random_numbers = True

    def __init__(
        self,
        params: Iterable,
        lr: float | Tensor = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bits: Optional[int] = None,
        update: str = "adamw",
        density: float = 0.25,
        projection: str = "columns",
        update_gap: int = 200,
        state_free: str = "sign",
        state_free_lr_scale: float = 1.0,
        reset_state: bool = True,
        block_order: str = "random",
        seed: int = 0,
        backend: str = "auto",
        nonfinite: str = "skip",
        state_dtype: str = "fp32",
    ):
        if bits is not None:
            _quant.check_bits(bits, "DQT")
        self.bits = bits
        self._update = update
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         density=density, update_gap=update_gap, projection=projection,
                         state_free=state_free, state_free_lr_scale=state_free_lr_scale,
                         reset_state=reset_state, block_order=block_order, seed=seed,
                         backend=backend, nonfinite=nonfinite, state_dtype=state_dtype)
        self.defaults["update"] = update

    @property
    def rho(self) -> float:
        """The state-full fraction of the quantized weights under the default ``update``:
        ``density`` for ``"frugal"``, 1 for ``"adamw"`` (every code has moments), 0 for
        ``"sign"``."""
        return {"adamw": 1.0, "sign": 0.0}.get(self._update, super().rho)

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        if self.bits is not None:
            for i, p in enumerate(params):
                if _quantized(p) and local(p).bits != self.bits:
                    raise ValueError(f"params[{i}] of param group {len(self.param_groups)} is "
                                     f"a {local(p).bits}-bit QuantLinear weight, but "
                                     f"DQT was given "
                                     f"bits={self.bits}")
        group = {"update": self._update, **param_group, "params": params}
        super().add_param_group(group)

    def _check_group(self, group: dict, where: str, read_device: bool = False) -> None:
        if group.get("state_dtype") == "int8":
            raise ValueError(f"{where}: DQT takes state_dtype='fp32' only: dqt_update_ "
                             "updates the quantized weights' AdamW moments in fp32 inside its "
                             "fused pass, and has no variant on 8-bit moments (int8 codes with "
                             "block scales, as adamw_int8_ takes) yet")
        super()._check_group(group, where, read_device)
        update = group.get("update", self._update)
        if update not in UPDATES:
            raise ValueError(f"{where}: update must be one of {', '.join(UPDATES)}; got "
                             f"{update!r}")
        if update == "frugal" and group["projection"] not in QUANT_PROJECTIONS:
            raise ValueError(f"{where}: update='frugal' on quantized weights takes projection "
                             f"{', '.join(QUANT_PROJECTIONS)}; {group['projection']!r} is a "
                             "low-rank projection, whose GEMMs need a float weight")
        if update == "frugal" and group.get("projected", True) and \
                group["projection"] not in SHARDED_PROJECTIONS and \
                self._sharded_weights(group.get("params", ())):
            raise ValueError(f"{where}: weights whose rows are split over ranks "
                             f"(shard_quantized_) take update='frugal' with projection "
                             f"{' or '.join(SHARDED_PROJECTIONS)}: {group['projection']!r} "
                             "draws along the rows, which each rank holds in part")

    def _sharded_weights(self, params) -> list:
        """The quantized weights whose rows are split over ranks: FSDP2's (DTensors) and
        those of the deprecated shard_quantized_ (a row shard on the weight)."""
        return [p for p in params if getattr(p, "shard", None) is not None or
                _quantized(p) and is_sharded(p)]

    def _family(self, group: dict) -> Projection:
        if not group["projected"] or group["update"] == "adamw":
            return _QUANT_FAMILIES["adamw"]
        if group["update"] == "sign":
            return _QUANT_FAMILIES["sign"]
        return _QUANT_FAMILIES[group["projection"]]

    def _check_saved_group(self, gi: int, saved: dict, group: dict) -> None:
        super()._check_saved_group(gi, saved, group)
        if saved.get("update", group["update"]) != group["update"]:
            raise ValueError(f"param group {gi}: update is {group['update']!r} here but "
                             f"{saved.get('update')!r} in the state dict")

    # ------------------------------------------- weights split by shard_quantized_
    # Their state is kept for the rank's rows. A state dict holds it in the global form
    # (as FSDP2's parameters' is, frugal_kernels.optim.sharding): the moments, whose rows
    # are the weight's, as DTensors of the whole weight's rows; the rest (step counts,
    # column ids) the same on every rank.

    def state_dict(self) -> dict:
        sd = super().state_dict()
        for pid, p in self._param_ids(sd):
            st = sd["state"].get(pid)
            if getattr(p, "shard", None) is None or not st:
                continue
            sd["state"][pid] = {key: p.shard.to_dtensor(value, (p.shard.rows, *value.shape[1:]))
                                if key in ("exp_avg", "exp_avg_sq") else value
                                for key, value in st.items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict["state"])
        for pid, p in self._param_ids(state_dict):
            st = state.get(pid)
            if getattr(p, "shard", None) is None or not st:
                continue
            state[pid] = {key: p.shard.block_of(value) if key in ("exp_avg", "exp_avg_sq")
                          else value for key, value in st.items()}
        super().load_state_dict({**state_dict, "state": state})

    def _param_ids(self, state_dict: dict):
        """(saved id, parameter) of the quantized weights, by position."""
        saved = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        return [(pid, p) for pid, p in zip(saved, params) if _quantized(p)]

    def _shard_groups(self) -> list:
        # The ranks see their own rows of the split weights' gradients: they decide a
        # non-finite skip together, as for FSDP2's parameters.
        shards = [p.shard for group in self.param_groups for p in group["params"]
                  if getattr(p, "shard", None) is not None and p.shard.num_shards > 1]
        return sharding.process_groups([*self._layouts.values(), *shards])

    def _rng_step(self) -> int:
        return self._steps_taken

    @torch._dynamo.disable
    def _apply(self, buckets, grads, grad_scale=None, found_inf=None) -> None:
        # Eager under torch.compile: the op's rng_step is an int, a new one each step.
        super()._apply(buckets, grads, grad_scale, found_inf)

