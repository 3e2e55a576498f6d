"""The row shard's split is torch.chunk's (DTensor's Shard(0), FSDP2's): the optimizers'
state and the quantized layers' codes are keyed by it, so a rank's rows must be the ones
DTensor gives it, ragged last shards and empty ranks included."""

import torch

from frugal_kernels._shard import row_chunk


def test_row_chunk_is_torch_chunk():
    for rows in range(0, 12):
        for ranks in range(1, 6):
            pieces = torch.arange(rows).chunk(ranks) if rows else ()
            for r in range(ranks):
                offset, size = row_chunk(rows, ranks, r)
                expected = pieces[r].tolist() if r < len(pieces) else []
                assert list(range(offset, offset + size)) == expected, (rows, ranks, r)
                assert 0 <= offset <= rows
