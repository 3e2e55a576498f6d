"""Optimizer state per rank under FSDP2, against one process: the figures of docs/integration.md.

Run it under torchrun (gloo on the CPU is enough: the figures are bytes, not times)::

    torchrun --standalone --nproc_per_node=2 examples/fsdp_state_bytes.py --model 20m

Every rank builds the same LLaMA preset, shards it with ``fully_shard`` (each decoder
layer, then the whole model), takes two steps of each optimizer on random tokens and
reports ``opt.state_bytes()``; the first rank also builds the unsharded model and
reports the one-process figure. BAdam is measured within its first block (an embedding
of 32000 x 256 for the 20m preset with ``include_embedding``). The DQT rows quantize the
model to 4 bits first (``quantize_``: every Linear but the head) and split its quantized
layers' rows with ``nn.shard_quantized_`` before ``fully_shard``. ``--only WORD`` runs
the rows whose name holds WORD.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import frugal_kernels as fk
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM

OPTIMIZERS = {
    **{f"FRUGAL {p}": (lambda m, p=p: fk.FRUGAL(fk.param_groups(m), density=0.25,
                                                  projection=p, update_gap=200))
       for p in ("blocks", "columns", "rows", "randk", "random", "svd")},
    "AdaFRUGAL columns": lambda m: fk.AdaFRUGAL(fk.param_groups(m), rho_start=0.25,
                                                rho_steps=1000, projection="columns"),
    "BAdam": lambda m: fk.BAdam(m, switch_every=50, switch_mode="ascending",
                                include_embedding=True, include_head=True),
    "AdamW (torch)": lambda m: torch.optim.AdamW(m.parameters()),
    **{f"DQT {u} (4-bit)": (lambda m, u=u: fk.DQT(m.parameters(), update=u, density=0.25,
                                                  projection="columns", update_gap=200))
       for u in ("adamw", "frugal", "sign")},
}


def state_bytes(opt) -> int:
    if hasattr(opt, "state_bytes"):
        return opt.state_bytes()
    from torch.distributed.tensor import DTensor
    return sum((v.to_local() if isinstance(v, DTensor) else v).untyped_storage().nbytes()
               for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def measure(model, make, batch) -> int:
    opt = make(model)
    for _ in range(2):
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return state_bytes(opt)


def build(config, name):
    model = LlamaForCausalLM(config, seed=0)
    if name.startswith("DQT"):
        fk.quantize_(model, bits=4)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="20m")
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    config = LlamaConfig.from_preset(args.model, max_seq_len=32)
    batch = torch.randint(0, config.vocab_size, (2 * world, 32),
                          generator=torch.Generator().manual_seed(0))
    rows = []
    mesh = init_device_mesh("cpu", (world,))
    for name, make in OPTIMIZERS.items():
        if args.only not in name:
            continue
        model = build(config, name)
        ignored = set(fk.nn.shard_quantized_(model, mesh)) if name.startswith("DQT") else None
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
        mine = measure(model, make, batch[2 * rank:2 * rank + 2])
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine)
        if rank == 0:
            one = measure(build(config, name), make, batch[:2])
            rows.append((name, one, per_rank))
    if rank == 0:
        print(f"| optimizer ({args.model}, {world} ranks) | one process | per rank | "
              "largest / one |")
        print("|---|---|---|---|")
        for name, one, per_rank in rows:
            print(f"| {name} | {one / 2**20:.2f} MiB | "
                  + " / ".join(f"{b / 2**20:.2f}" for b in per_rank)
                  + f" MiB | {max(per_rank) / one:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
