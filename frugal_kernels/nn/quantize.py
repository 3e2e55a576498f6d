"""``quantize_``: swap a model's ``nn.Linear`` layers for :class:`QuantLinear` in place."""

from __future__ import annotations

import re
from typing import Iterable, List, Optional, Union

import torch
from torch import nn

from frugal_kernels import _quant
from frugal_kernels.nn.quant_linear import QuantLinear

__all__ = ["quantize_"]

DEFAULT_SKIP = ("lm_head",)


def _matches(name: str, patterns: List[re.Pattern]) -> bool:
    return any(p.fullmatch(name) or p.fullmatch(name.rsplit(".", 1)[-1]) for p in patterns)


def quantize_(model: nn.Module, bits: int = 4, skip: Union[str, Iterable[str]] = DEFAULT_SKIP,
              scale: str = "tensor", dtype: Optional[torch.dtype] = None,
              seed: int = 0, scale_init: str = "absmean") -> List[str]:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`QuantLinear` built from it
    (:meth:`QuantLinear.from_linear`), in place; returns the names replaced.

    Args:
        bits, scale, scale_init, dtype: as for :class:`QuantLinear` (``dtype``, of
            the bias and the weight gradient, defaults to the layer's, float32 for
            fp32).
        skip: layers kept as they are: names or regular expressions, matched
            against the whole module name (``model.layers.0.mlp.up``) or its
            last part (``lm_head``, the default: the output head stays in full
            precision, as in the DQT paper).
        seed: the layers' rounding seeds are ``seed``, ``seed + 1``, ... in
            module order, so no two layers share their random numbers.

    A layer registered under several names (a shared block) becomes one
    QuantLinear registered under all of them, and each of its names is returned; it
    is skipped only if every name is. A weight shared between layers (tied
    embeddings and head) cannot be quantized for one of them only: such a layer
    raises a ValueError unless skipped. Every new layer is built before any is put
    in place, so a call that raises (that, or a non-finite weight) leaves the model
    as it was.

    The model gets a ``load_state_dict`` pre-hook (once, however often it is
    converted; it travels with ``copy.deepcopy`` and ``torch.save`` of the model):
    before anything of the model loads, it checks every QuantLinear's entries as the
    layer's own load would, and raises the layer's error (a float weight, another
    width, codes out of range) with nothing copied. Without it torch would copy
    every module that fits (the embedding, the head) and raise at the end. It
    guards ``model.load_state_dict``; a load into one of its submodules, or through
    a module that holds ``model`` (which copies its own tensors and the modules
    before ``model`` first), has each layer's own check only: the layer loads
    nothing, the other modules load.
    """
    _quant.check_bits(bits, "quantize_")
    _quant.check_scale_init(scale_init, "quantize_")
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_ takes an nn.Module, got {type(model).__name__}")
    names = [skip] if isinstance(skip, str) else list(skip)
    try:
        patterns = [re.compile(n) for n in names]
    except re.error as e:
        raise ValueError(f"quantize_: skip has an invalid pattern: {e}") from None
    owners = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(module))
    # Every name of every Linear: a module registered twice appears under both.
    names = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if type(module) is nn.Linear:
            names.setdefault(id(module), (module, []))[1].append(name)
    chosen = []
    for module, its_names in names.values():
        if all(_matches(name, patterns) for name in its_names):
            continue
        if len(owners[id(module.weight)]) > 1:
            raise ValueError(f"quantize_: {its_names[0]}'s weight is shared with another "
                             "module (tied weights); skip it or untie it")
        chosen.append((module, its_names))
    new = [QuantLinear.from_linear(linear, bits=bits, scale=scale, dtype=dtype, seed=seed + k,
                                   scale_init=scale_init)
           for k, (linear, _) in enumerate(chosen)]
    replaced = []
    for layer, (_, its_names) in zip(new, chosen):
        for name in its_names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, layer)
            replaced.append(name)
    if not any(getattr(hook, "hook", None) is _check_quantized_load
               for hook in model._load_state_dict_pre_hooks.values()):
        model.register_load_state_dict_pre_hook(_check_quantized_load)
    return replaced


def _check_quantized_load(model: nn.Module, state_dict, prefix, local_metadata, strict,
                          missing_keys, unexpected_keys, error_msgs) -> None:
    """Refuse a state dict that a QuantLinear of ``model`` would refuse (a float weight, a
    layer of another width, bad codes) before anything of the model is copied: torch's
    ``load_state_dict`` goes on through the other modules after a layer's error and
    raises at the end, when the embedding, the head and every layer that fit have been
    overwritten from the rejected checkpoint."""
    problems = []
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, QuantLinear):
            problem, _, _ = module._check_load(state_dict, f"{prefix}{name}." if name else prefix)
            if problem is not None:
                problems.append(problem)
    if problems:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}:\n\t"
                           + "\n\t".join(problems))
