"""Microbenchmarks of the fused ops: time, bytes moved, roofline fraction, peers.

Each op registers a factory (:func:`register`) that builds its cases for a
parameter count, dtype and device; ops added later join the sweep the same way.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch

from frugal_kernels import _quant, ops
from frugal_kernels.bench.timing import measure_rounds, ratio_spread
from frugal_kernels._layout import (MomentBlocks, lowrank_dim, lowrank_side, project, subset_dim,
                                    subset_state_shape)
from frugal_kernels.optim import subspace_choice

TENSOR_NUMEL = 1 << 20  # the param set is cut into tensors of this size, like an LLM's matrices


@dataclass
class OpCase:
    op: str
    variant: str
    bytes: int                               # bytes the op must move
    run: Callable[[str], Callable[[], None]]  # backend -> a call to time
    backends: Sequence[str] = ops.BACKENDS


_FACTORIES: Dict[str, Callable[..., List[OpCase]]] = {}


def register(op: str):
    """Decorator: ``factory(tensors, dtype, rho) -> [OpCase]`` joins the sweep."""
    def wrap(factory):
        _FACTORIES[op] = factory
        return factory
    return wrap


def param_set(numel: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> List[torch.Tensor]:
    """``numel`` parameters as square-ish 2-D tensors of about TENSOR_NUMEL elements."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors, left = [], numel
    while left > 0:
        n = min(TENSOR_NUMEL, left)
        rows = max(1, int(math.sqrt(n)))
        while n % rows:
            rows -= 1
        tensors.append(torch.randn(rows, n // rows, generator=gen, device=device, dtype=dtype))
        left -= n
    return tensors


def _like(tensors, dtype=None, fill=None):
    out = [torch.empty_like(t, dtype=dtype or t.dtype) for t in tensors]
    for t in out:
        t.normal_() if fill is None else t.fill_(fill)
    return out


@register("adamw_")
def _adamw_cases(params, dtype, rho):
    grads = _like(params)
    m = _like(params, torch.float32, 0.0)
    v = _like(params, torch.float32, 0.0)
    n = sum(p.numel() for p in params)
    size = params[0].element_size()

    def run(backend):
        return lambda: ops.adamw_(params, grads, m, v, lr=1e-4, beta1=0.9, beta2=0.999,
                                  eps=1e-8, weight_decay=0.01, step=10, backend=backend)
    return [OpCase("adamw_", "", n * (3 * size + 16), run)]


@register("adamw_int8_")
def _adamw_int8_cases(params, dtype, rho):
    grads = _like(params)
    moments = [[], [], [], []]
    for p in params:
        scales = MomentBlocks(p.shape).scale_shape
        for lst, shape, kind in zip(moments, (p.shape, scales, p.shape, scales),
                                    (torch.int8, torch.float32, torch.uint8, torch.float32)):
            lst.append(torch.zeros(shape, dtype=kind, device=p.device))
    n = sum(p.numel() for p in params)
    scale_bytes = sum(s.numel() for s in moments[1]) * 2 * 4
    size = params[0].element_size()

    def run(backend):
        return lambda: ops.adamw_int8_(params, grads, *moments, lr=1e-4, beta1=0.9, beta2=0.999,
                                       eps=1e-8, weight_decay=0.01, step=10, backend=backend)
    # Params read and written, grads read, two 1-byte codes and their scales read and written.
    return [OpCase("adamw_int8_", "", n * (3 * size + 4) + 2 * scale_bytes, run)]


@register("sign_sgd_")
def _sign_sgd_cases(params, dtype, rho):
    grads = _like(params)
    n = sum(p.numel() for p in params)

    def run(backend):
        return lambda: ops.sign_sgd_(params, grads, lr=1e-4, weight_decay=0.01, backend=backend)
    return [OpCase("sign_sgd_", "", n * 3 * params[0].element_size(), run)]


@register("frugal_step_")
def _frugal_step_cases(params, dtype, rho):
    grads = _like(params)
    gen = torch.Generator().manual_seed(1)
    size = params[0].element_size()
    cases = []
    for kind in ("rows", "columns", "flat"):
        indices, m, v = [], [], []
        for p in params:
            dim = subset_dim(p, kind)
            idx = subspace_choice.choose_subset(dim, subspace_choice.subset_size(rho, dim), gen, p.device)
            indices.append(idx)
            shape = subset_state_shape(p, kind, idx.numel())
            m.append(torch.zeros(shape, device=p.device))
            v.append(torch.zeros(shape, device=p.device))
        full = sum(x.numel() for x in m)
        n = sum(p.numel() for p in params)
        index_bytes = sum(i.numel() * i.element_size() for i in indices)

        def run(backend, indices=indices, m=m, v=v, kind=kind):
            return lambda: ops.frugal_step_(params, grads, m, v, indices, kind=kind, lr=1e-4,
                                            beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                                            step=10, backend=backend, check_indices=False)
        cases.append(OpCase("frugal_step_", kind, n * 3 * size + full * 16 + index_bytes, run))
    return cases


@register("frugal_step_int8_")
def _frugal_step_int8_cases(params, dtype, rho):
    grads = _like(params)
    gen = torch.Generator().manual_seed(1)  # frugal_step_'s subsets
    size = params[0].element_size()
    cases = []
    for kind in ("rows", "columns"):
        indices, moments = [], [[], [], [], []]
        for p in params:
            dim = subset_dim(p, kind)
            idx = subspace_choice.choose_subset(dim, subspace_choice.subset_size(rho, dim), gen, p.device)
            indices.append(idx)
            shape = subset_state_shape(p, kind, idx.numel())
            scales = MomentBlocks(shape).scale_shape
            for lst, s, code in zip(moments, (shape, scales, shape, scales),
                                    (torch.int8, torch.float32, torch.uint8, torch.float32)):
                lst.append(torch.zeros(s, dtype=code, device=p.device))
        full = sum(x.numel() for x in moments[0])
        scale_bytes = sum(x.numel() for x in moments[1]) * 2 * 4
        n = sum(p.numel() for p in params)
        index_bytes = sum(i.numel() * i.element_size() for i in indices)

        def run(backend, indices=indices, moments=moments, kind=kind):
            return lambda: ops.frugal_step_int8_(params, grads, *moments, indices, kind=kind,
                                                 lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                                                 weight_decay=0.01, step=10, backend=backend,
                                                 check_indices=False)
        # frugal_step_'s bytes with two 1-byte codes read and written per state-full
        # coordinate (4 B where fp32 moments move 16) and their scales.
        cases.append(OpCase("frugal_step_int8_", kind,
                            n * 3 * size + full * 4 + 2 * scale_bytes + index_bytes, run))
    return cases


@register("lowrank_step_")
def _lowrank_step_cases(params, dtype, rho):
    grads = _like(params)
    gen = torch.Generator().manual_seed(2)
    projs, lows, ups, sides = [], [], [], []
    for p, g in zip(params, grads):
        rank = max(1, subspace_choice.subset_size(rho, lowrank_dim(p.shape)))
        proj = subspace_choice.make_projection("random", g, rank, gen)
        side = lowrank_side(p.shape)
        lows.append(project(g, proj, side))
        ups.append(torch.zeros_like(lows[-1]))
        projs.append(proj)
        sides.append(side)
    n = sum(p.numel() for p in params)

    def run(backend):
        return lambda: ops.lowrank_step_(params, grads, ups, lows, projs, sides, lr=1e-4,
                                         weight_decay=0.01, backend=backend)
    # What it must move: p read and written, g read; the low-rank factors are small.
    return [OpCase("lowrank_step_", "random", n * 3 * params[0].element_size(), run,
                   backends=tuple(sorted(ops.CAPABILITIES["frugal::lowrank_step_"])))]


SMALL_SIDE, SMALL_RANK = 64, 16  # the small matrices lowrank_adamw_step_ is for


@register("lowrank_adamw_step_")
def _lowrank_adamw_step_cases(params, dtype, rho):
    """The param set cut into 64 x 64 matrices at rank 16: the op does the whole low-rank
    step of small matrices in one call (FRUGAL sends it those of rows * cols * rank up
    to 2**16), where the per-tensor calls of the other path cost more than the math."""
    gen = torch.Generator().manual_seed(3)
    side_numel = SMALL_SIDE * SMALL_SIDE
    mats = [chunk.view(SMALL_SIDE, SMALL_SIDE) for p in params
            for chunk in p.view(-1)[: p.numel() // side_numel * side_numel].split(side_numel)]
    grads = _like(mats)
    projs, m, v, sides = [], [], [], []
    for g in grads:
        proj = subspace_choice.make_projection("random", g, SMALL_RANK, gen)
        side = lowrank_side(g.shape)
        low = project(g, proj, side)
        projs.append(proj)
        sides.append(side)
        m.append(torch.zeros(low.shape, device=g.device))
        v.append(torch.zeros(low.shape, device=g.device))
    n = sum(t.numel() for t in mats)
    moments = sum(t.numel() for t in m)

    def run(backend):
        return lambda: ops.lowrank_adamw_step_(mats, grads, m, v, projs, sides, lr=1e-4,
                                               beta1=0.9, beta2=0.999, eps=1e-8,
                                               weight_decay=0.01, step=10, backend=backend)
    # p read and written, g read, the compact moments read and written; like lowrank_step_
    # it is compute-bound (its GEMMs), so its roofline fraction is low by nature.
    return [OpCase("lowrank_adamw_step_", f"{SMALL_SIDE}x{SMALL_SIDE} rank {SMALL_RANK}",
                   n * 3 * params[0].element_size() + moments * 16, run,
                   backends=tuple(sorted(ops.CAPABILITIES["frugal::lowrank_adamw_step_"])))]


@register("dqt_update_")
def _dqt_update_cases(params, dtype, rho, bits: int = 4):
    """The params' shapes as 4-bit codes with per-row scales; ``dtype`` is the
    gradients'. Variants: AdamW (every row state-full), FRUGAL columns at ``rho``,
    SignSGD (none)."""
    gen = torch.Generator().manual_seed(3)
    grads = _like(params)
    codes = [torch.randint(0, 255, _quant.packed_shape(tuple(p.shape), bits), dtype=torch.uint8,
                           generator=gen).to(p.device) for p in params]
    scales = [torch.full((p.shape[0],), 0.01, device=p.device) for p in params]
    n = sum(p.numel() for p in params)
    code_bytes = 2 * sum(c.numel() for c in codes)  # read and written
    size = params[0].element_size()
    cases = []
    for variant, kind, density in (("adamw", "rows", 1.0), ("columns", "columns", rho),
                                   ("sign", "flat", 0.0)):
        indices, m, v = [], [], []
        for p in params:
            dim = subset_dim(p, kind)
            idx = subspace_choice.choose_subset(dim, subspace_choice.subset_size(density, dim), gen, p.device)
            shape = subset_state_shape(p, kind, idx.numel())
            indices.append(idx)
            m.append(torch.zeros(shape, device=p.device))
            v.append(torch.zeros(shape, device=p.device))
        moments = sum(x.numel() for x in m)
        index_bytes = sum(i.numel() * i.element_size() for i in indices)

        def run(backend, indices=indices, m=m, v=v, kind=kind):
            return lambda: ops.dqt_update_(codes, scales, grads, m, v, indices, bits=bits,
                                           kind=kind, seeds=list(range(len(codes))), lr=1e-4,
                                           beta1=0.9, beta2=0.999, eps=1e-8,
                                           weight_decay=0.01, step=10, rng_step=10,
                                           backend=backend, check_indices=False)
        cases.append(OpCase("dqt_update_", f"{bits}-bit {variant}",
                            code_bytes + n * size + moments * 16 + index_bytes, run,
                            backends=tuple(sorted(ops.CAPABILITIES["frugal::dqt_update_"]))))
    return cases


@register("grad_norm")
def _grad_norm_cases(params, dtype, rho):
    """The global norm and non-finite flag: one read of every gradient is all it moves."""
    grads = _like(params)
    n = sum(p.numel() for p in params)

    def run(backend):
        return lambda: ops.grad_norm(grads, backend=backend)
    return [OpCase("grad_norm", "", n * params[0].element_size(), run)]


# The ops the sweep knows, as `frugal-kernels bench --ops` takes them.
OP_NAMES = tuple(_FACTORIES)


def _default_backends(device: torch.device) -> List[str]:
    usable = ops.usable_backends(device.type)
    # The torch backend is the readable reference (a loop of small ops) and the
    # interpreted Triton backend is a test vehicle: neither is a speed contender.
    return [b for b in usable if b not in ("torch",) and not (b == "triton" and device.type == "cpu")]


def sweep(*, device: torch.device, numels: Sequence[int], dtypes: Sequence[torch.dtype],
          rho: float = 0.25, backends: Sequence[str] = None, op_names: Sequence[str] = None,
          rounds: int = 15, progress=None) -> List[dict]:
    """Time every registered op case; one row per (op, variant, backend, dtype, size)."""
    backends = list(backends or _default_backends(device))
    rows = []
    for numel in numels:
        for dtype in dtypes:
            params = param_set(numel, dtype, device)
            src = torch.empty(numel, dtype=torch.float32, device=device).normal_()
            dst = torch.empty_like(src)
            # The roofline: an in-place op of the optimizers' access pattern (read a and
            # b, write a back: 12 B per fp32 value). A plain copy also reads the
            # destination before writing it (write-allocate) while counting only 8 B,
            # which flatters every in-place op; it is kept beside it for reference.
            acc = torch.zeros(numel, dtype=torch.float32, device=device)
            tiny = src * 1e-30  # adding it leaves acc finite however many rounds run
            fused_params = [torch.nn.Parameter(p.clone()) for p in params]
            for p in fused_params:
                p.grad = torch.randn_like(p)
            fused = torch.optim.AdamW(fused_params, lr=1e-4, weight_decay=0.01, fused=True)
            candidates = {"copy": lambda dst=dst, src=src: dst.copy_(src),
                          "inplace_add": lambda acc=acc, tiny=tiny: acc.add_(tiny),
                          "torch_adamw_fused": fused.step}
            cases = {}
            for name in op_names or _FACTORIES:
                for case in _FACTORIES[name](params, dtype, rho):
                    for backend in backends:
                        # The capability table decides: an op without a kernel of this
                        # backend (frugal_step_int8_ has no cuda one) has no row for it.
                        if backend in case.backends and \
                                backend in ops.usable_backends(device.type, "frugal::" + case.op):
                            key = f"{case.op}[{case.variant}]/{backend}"
                            candidates[key] = case.run(backend)
                            cases[key] = (case, backend)
            samples = measure_rounds(candidates, device=device, rounds=rounds)
            times = {name: statistics.median(s) for name, s in samples.items()}
            copy_gbps = 2 * numel * 4 / times["copy"] / 1e9
            roofline_gbps = 3 * numel * 4 / times["inplace_add"] / 1e9
            for key, (case, backend) in cases.items():
                t = times[key]
                gbps = case.bytes / t / 1e9
                rows.append({
                    "op": case.op, "variant": case.variant, "backend": backend,
                    "dtype": str(dtype).replace("torch.", ""), "numel": numel, "seconds": t,
                    "bytes": case.bytes, "gbps": gbps, "copy_gbps": copy_gbps,
                    "copy_fraction": gbps / copy_gbps,
                    "roofline_gbps": roofline_gbps, "roofline_fraction": gbps / roofline_gbps,
                    "speedup_vs_torch_adamw_fused": times["torch_adamw_fused"] / t,
                    "speedup_spread": ratio_spread(samples["torch_adamw_fused"], samples[key]),
                    "rho": rho,
                })
            if progress is not None:
                progress.update(1)
            del params, fused_params, fused, src, dst, acc, tiny
    return rows
