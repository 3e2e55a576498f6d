"""Choosing FRUGAL's state-full subspace: which blocks, coordinates or directions.

Pure functions of a shape, a size and a ``torch.Generator``: every random
choice comes from the optimizer's own generator, on the CPU, so that it is the
same on every rank and device and is restored exactly from a checkpoint.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Tuple

import torch
from torch import Tensor

from frugal_kernels._layout import RIGHT, lowrank_side, matrix_shape

# FRUGAL's projections (frugal_kernels.optim.projections.FAMILIES has one family for each)
# and the orders of the blocks projection.
PROJECTIONS = ("blocks", "columns", "rows", "randk", "random", "svd")
BLOCK_ORDERS = ("random", "ascending", "descending", "mirror")


def subset_size(density: float, dim: int) -> int:
    """How many of ``dim`` rows, columns, coordinates or directions a density keeps.

    round(density * dim), as the FRUGAL paper does.
    """
    return min(dim, max(0, round(density * dim)))


def num_active_blocks(density: float, num_blocks: int, order: str) -> int:
    n = subset_size(density, num_blocks)
    if order == "mirror" and n % 2:
        # mirror takes blocks in pairs (one from each end)
        n = n + 1 if n < num_blocks else n - 1
    return n


def choose_blocks(num_blocks: int, num_active: int, order: str, cursor: int,
                  generator: torch.Generator) -> Tuple[List[int], int]:
    """Indices of the state-full blocks and the next cursor of the order.

    ``random`` draws a fresh subset each time; ``ascending`` / ``descending``
    walk the blocks cyclically from the cursor; ``mirror`` walks pairs
    (i, n - 1 - i) from both ends towards the middle.
    """
    if num_blocks == 0 or num_active == 0:
        return [], cursor
    if order == "random":
        chosen = torch.randperm(num_blocks, generator=generator)[:num_active]
        return sorted(chosen.tolist()), cursor
    if order == "ascending":
        chosen = [(cursor + i) % num_blocks for i in range(num_active)]
        return sorted(chosen), (cursor + num_active) % num_blocks
    if order == "descending":
        chosen = [(cursor - i) % num_blocks for i in range(num_active)]
        return sorted(chosen), (cursor - num_active) % num_blocks
    if order == "mirror":
        half = num_blocks // 2
        if half == 0:
            return [0], cursor
        pairs = num_active // 2
        chosen = set()
        for i in range(pairs):
            j = (cursor + i) % half
            chosen.update((j, num_blocks - 1 - j))
        return sorted(chosen), (cursor + pairs) % half
    raise ValueError(f"unknown block_order {order!r}")


def choose_subset(dim: int, k: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """k sorted unique ids out of range(dim), drawn uniformly.

    int32 when dim fits, to halve the memory the ids take beside the state.
    """
    dtype = torch.int32 if dim < 2**31 else torch.int64
    ids = torch.randperm(dim, generator=generator)[:k].sort().values
    return ids.to(dtype=dtype, device=device)


@contextlib.contextmanager
def _one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """LAPACK's QR and SVD on the CPU give results that depend on the thread count (seen:
    1.6e-7 apart for a QR, 1.3e-4 for an SVD, 1 vs 2 threads), which would make the subspace,
    and so the whole run, depend on it. One thread makes them the same on every machine;
    the factorizations run once per subspace change."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make_projection(projection: str, grad: Tensor, rank: int,
                    generator: torch.Generator) -> Tensor:
    """A projection with orthonormal rows (RIGHT, [r, n]) or columns (LEFT, [m, r]), fp32.

    ``svd``: the top singular vectors of the current gradient (GaLore);
    ``random``: a random semi-orthogonal matrix (QR of a Gaussian matrix drawn
    from ``generator`` on the CPU). Both are independent of the thread count.

    A NaN or an infinity in the gradient counts as 0 for ``svd``: the step that
    holds it is skipped (nonfinite="skip", a GradScaler) while its subspace
    change still happens (the host never learns of the skip), and one such value
    would otherwise make the SVD fail or fill the projection with NaN for the
    ``update_gap`` steps it is used.
    """
    m, n = matrix_shape(grad.shape)
    side = lowrank_side(grad.shape)
    if projection == "svd":
        finite = grad.reshape(m, n).float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        with _one_thread_on_cpu(grad.device):
            u, _, vh = torch.linalg.svd(finite, full_matrices=False)
        return (vh[:rank] if side == RIGHT else u[:, :rank]).contiguous()
    if projection == "random":
        dim = n if side == RIGHT else m
        gaussian = torch.randn(dim, rank, generator=generator, dtype=torch.float32)
        with _one_thread_on_cpu(gaussian.device):
            q, r = torch.linalg.qr(gaussian)
        # Fix the signs so that the distribution is uniform (Haar) over the
        # semi-orthogonal matrices, not biased by QR's convention.
        q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))
        q = q.to(grad.device)
        return (q.t() if side == RIGHT else q).contiguous()
    raise ValueError(f"unknown low-rank projection {projection!r}")
