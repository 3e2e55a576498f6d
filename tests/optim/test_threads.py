"""Low-rank subspaces do not depend on the number of CPU threads."""

import pytest
import torch

from frugal_kernels.optim import subspace_choice


@pytest.mark.parametrize("projection", ["random", "svd"])
def test_projection_is_the_same_for_any_thread_count(projection):
    grad = torch.randn(700, 300, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            results.append(subspace_choice.make_projection(projection, grad, 120,
                                                    torch.Generator().manual_seed(3)))
            assert torch.get_num_threads() == n  # restored after the factorization
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        assert torch.equal(r, results[0])
