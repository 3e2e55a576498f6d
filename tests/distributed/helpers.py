"""What the distributed tests share: a place for the ranks to meet and to leave,
the checkpoint round trip through torch.distributed.checkpoint, and the measure of
how far two runs are apart."""

from __future__ import annotations

import inspect
import os
import uuid

import torch.distributed as dist
from torch import nn

import frugal_kernels as fk


def rendezvous(folder: str) -> str:
    """The ``init_method`` for the ranks of one spawn: a new file in ``folder`` (a
    FileStore). A free TCP port, chosen then bound by the ranks later, can be taken by
    another process on a shared machine in between; a file of its own cannot."""
    return "file://" + os.path.join(os.path.abspath(folder), f"rendezvous-{uuid.uuid4().hex}")


def end_rank() -> None:
    """End a spawned rank once its results are saved: a barrier, so that no rank leaves
    while another has a collective in flight, then ``os._exit(0)``, without tearing the
    process group down. A DistributedDataParallel module freed after
    ``destroy_process_group()`` destroys the gloo group from its Reducer with the GIL
    held, joining gloo's loop thread while that thread waits for the GIL to free a
    finished collective's tensors: the rank never exits (seen in CI with torch 2.13,
    ``ProcessGroupGloo::~ProcessGroupGloo`` in ``std::thread::join`` under
    ``Reducer::~Reducer``), and the spawn's join waits for it forever."""
    dist.barrier()
    os._exit(0)


def ddp_without_buffer_sync(module, **options):
    """DistributedDataParallel that never broadcasts the module's buffers, neither at
    construction nor in forward. torch 2.13 deprecates ``broadcast_buffers`` for
    ``forward_sync_buffers`` (with a FutureWarning); torch 2.11 has only the former.
    With ``init_sync=False`` there is no construction sync, so the two mean the same."""
    accepted = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    flag = "forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"
    return nn.parallel.DistributedDataParallel(module, init_sync=False, **{flag: False},
                                               **options)


def save(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)


def load(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    model_sd = get_model_state_dict(model)
    optim_sd = fk.optimizer_state_dict_template(model, opt, path)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_model_state_dict(model, model_sd)
    set_optimizer_state_dict(model, opt, optim_sd)


def fraction_apart(a, b, tol=1e-5):
    return float(((a - b).abs() > tol).float().mean())
