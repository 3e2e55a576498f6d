"""Resuming the package's optimizers from ``torch.distributed.checkpoint`` (DCP).

Saving needs nothing of ours: ``get_optimizer_state_dict(model, optimizer)``
gives the state dict (the optimizers put all they need in ``"state"`` and
``"param_groups"``, the two entries it keeps) and ``dcp.save`` writes it.

Loading does. ``dcp.load`` loads *in place*: into a state dict shaped like the
checkpoint, with a tensor of the saved shape for every saved tensor, which
users take from the fresh optimizer (``get_optimizer_state_dict`` again). An
AdamW's state has the same entries and shapes at every step, so that works;
ours do not. FRUGAL's ``blocks`` keep moments for the active tensors only,
which change at every subspace change; AdaFRUGAL's subsets shrink with rho;
BAdam keeps state for its active block only. A fresh optimizer's state dict
then names other tensors, or other shapes, than the checkpoint's, and DCP
refuses it (or quietly loads only the entries both have).

:func:`optimizer_state_dict_template` builds the dict to load into from the
checkpoint's metadata instead: for every saved state tensor, an empty one of the
saved shape and dtype, a DTensor split as its parameter is where the optimizer's
state dict holds a DTensor (:func:`frugal_kernels.optim.sharding.sharded_entry`),
so that DCP reshards the saved tensors onto this run's ranks, whatever their
number when it was saved. ``set_optimizer_state_dict`` then hands the loaded
dict to the optimizer's ``load_state_dict``, which takes what it needs.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

import torch
from torch import nn

from frugal_kernels._shard import is_sharded
from frugal_kernels.optim import sharding

__all__ = ["optimizer_state_dict_template"]


def optimizer_state_dict_template(model: nn.Module, optimizer: torch.optim.Optimizer,
                                  checkpoint: Union[str, os.PathLike, Any], key: str = "optim",
                                  options: Optional[Any] = None) -> Dict[str, Any]:
    """The optimizer state dict to hand ``dcp.load`` for ``optimizer`` (FRUGAL,
    AdaFRUGAL, BAdam, or any other), shaped like the one saved under ``key`` in
    ``checkpoint`` (a checkpoint folder, a DCP ``StorageReader`` or its ``Metadata``).

    Call it on every rank, where ``get_optimizer_state_dict`` would be called (it
    calls it, for the param groups: under FSDP2 a collective)::

        model_sd = get_model_state_dict(model)
        optim_sd = frugal_kernels.optimizer_state_dict_template(model, optimizer, path)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_model_state_dict(model, model_sd)
        set_optimizer_state_dict(model, optimizer, optim_sd)

    ``options`` (a ``StateDictOptions``) are passed to ``get_optimizer_state_dict``;
    with ``full_state_dict=True`` the template holds plain tensors of the whole, with
    ``cpu_offload=True`` it lies on the CPU. Every parameter gets a state entry, empty
    where the checkpoint has none (a state-free tensor, an inactive block), so that
    ``set_optimizer_state_dict`` finds one for every parameter that trains.

    For a BAdam this also makes the parameters with saved state (the saved active
    block's) trainable: ``set_optimizer_state_dict`` drops the state of parameters
    that do not require grad, and BAdam's inactive blocks do not. Its
    ``load_state_dict`` then sets every block's flags as the checkpoint's schedule
    says.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    metadata = _metadata(checkpoint)
    osd = get_optimizer_state_dict(model, optimizer, options=options)
    full = bool(options is not None and options.full_state_dict)
    cpu = bool(options is not None and options.cpu_offload)
    saved: Dict[str, Dict[str, Any]] = {}
    prefix = f"{key}.state."
    for name, md in metadata.state_dict_metadata.items():
        if name.startswith(prefix):
            # "<key>.state.<fqn>.<entry>": the entries' names have no dots, FQNs do.
            fqn, _, entry = name[len(prefix):].rpartition(".")
            saved.setdefault(fqn, {})[entry] = md
    state: Dict[str, Dict[str, Any]] = {}
    with_state = []
    for group, saved_group in zip(optimizer.param_groups, osd["param_groups"]):
        for p, fqn in zip(group["params"], saved_group["params"]):
            entry = state[fqn] = {}
            for name, md in saved.get(fqn, {}).items():
                if not isinstance(md, TensorStorageMetadata):
                    entry[name] = None  # a saved object: dcp.load puts it in
                    continue
                entry[name] = _empty(md, p, name, full, cpu)
            if entry:
                with_state.append(p)
    osd["state"] = state
    # set_optimizer_state_dict passes on the state of the parameters that require
    # grad only: BAdam's inactive blocks do not, and the saved active block may be one.
    expect = getattr(optimizer, "_expect_saved_state", None)
    if expect is not None:
        expect(with_state)
    return osd


def _empty(md: Any, p: torch.Tensor, name: str, full: bool, cpu: bool) -> torch.Tensor:
    dtype = md.properties.dtype
    if is_sharded(p) and sharding.sharded_entry(name, p) and not full:
        from torch.distributed import tensor

        empty = tensor.empty(*md.size, dtype=dtype, device_mesh=p.device_mesh,
                             placements=p.placements)
        return empty.cpu() if cpu else empty
    # Step counts live on the CPU, as the optimizers keep them.
    device = "cpu" if cpu or name == "step" else p.device
    return torch.empty(md.size, dtype=dtype, device=device)


def _metadata(checkpoint: Any) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    if isinstance(checkpoint, Metadata):
        return checkpoint
    if isinstance(checkpoint, (str, os.PathLike)):
        return FileSystemReader(os.fspath(checkpoint)).read_metadata()
    if callable(getattr(checkpoint, "read_metadata", None)):
        return checkpoint.read_metadata()
    raise TypeError(f"checkpoint must be a checkpoint folder, a torch.distributed.checkpoint "
                    f"StorageReader or its Metadata, got {type(checkpoint).__name__}")
