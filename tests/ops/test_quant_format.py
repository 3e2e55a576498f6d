"""The INT-n format and the counter-based generator of frugal_kernels._quant.

Every backend of dqt_update_ and nn.QuantLinear read this format; the golden
values pin the generator so that a kernel (or a change here) that draws other
numbers fails loudly instead of silently changing every trained model.
"""

import pytest
import torch

from frugal_kernels import _quant as Q


@pytest.mark.parametrize("bits", Q.QUANT_BITS)
@pytest.mark.parametrize("cols", [1, 2, 3, 5, 7, 8, 9, 16, 17, 33])
def test_pack_unpack_round_trip(bits, cols):
    torch.manual_seed(cols)
    q = torch.randint(-Q.qmax(bits), Q.qmax(bits) + 1, (4, cols))
    packed = Q.pack(q, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (4, (cols * bits + 7) // 8)
    assert torch.equal(Q.unpack(packed, bits, cols), q.to(torch.int32))


def test_packing_is_a_little_endian_bit_stream():
    # Three 3-bit codes -3, 0, 3 are the fields 0, 3, 6: bits 000 110 011 from bit 0.
    packed = Q.pack(torch.tensor([[-3, 0, 3]]), 3)
    assert packed.tolist() == [[0b10_011_000, 0b1]]


def test_code_range():
    assert [Q.qmax(b) for b in Q.QUANT_BITS] == [1, 3, 7, 127]
    with pytest.raises(ValueError, match="bits must be one of 2, 3, 4, 8"):
        Q.check_bits(5, "here")


def test_generator_golden_values():
    assert Q._mix32_int(0) == 0
    assert [Q._mix32_int(x) for x in (1, 2, 0xFFFFFFFF)] == [1753845952, 3507691905, 1734902346]
    assert Q.rng_key(0, 0) == 2926543089
    assert Q.rng_key(12345, 678) == 978262010
    # The tensor and the integer versions agree, wrapping included.
    xs = torch.randint(0, 2**32, (1000,), dtype=torch.int64)
    assert Q.mix32(xs).tolist() == [Q._mix32_int(int(x)) for x in xs]


def test_uniforms_are_in_range_and_depend_on_every_key():
    idx = torch.arange(10_000)
    u = Q.uniform(7, 3, idx)
    assert u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    for other in (Q.uniform(8, 3, idx), Q.uniform(7, 4, idx)):
        assert (other != u).float().mean() > 0.99


def test_a_shifted_seed_draws_the_uniforms_of_shifted_indices():
    gen = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 2**32, (500,), dtype=torch.int64, generator=gen).tolist()
    assert [Q._unmix32_int(Q._mix32_int(x)) for x in xs] == xs
    idx = torch.arange(1000)
    for seed, step, offset in ((0, 0, 5), (7, 3, 1000), (2**32 - 1, 2**32 - 1, 2**31 + 12345)):
        shifted = Q.shifted_seed(seed, step, offset)
        assert 0 <= shifted < 2**32
        assert torch.equal(Q.uniform(shifted, step, idx), Q.uniform(seed, step, idx + offset))
    assert Q.shifted_seed(7, 3, 0) == 7


def test_stochastic_rounding_is_unbiased_and_clamped():
    n = 200_000
    u = Q.uniform(1, 2, torch.arange(n))
    for value in (0.3, -1.7, 2.5):
        q = Q.stochastic_round(torch.full((n,), value), u, 4)
        # A Bernoulli(p) mean over n draws has standard deviation <= 0.5 / sqrt(n) ~ 0.0011;
        # 5 of them bound a false failure below 1e-6.
        assert abs(float(q.float().mean()) - value) < 5 * 0.5 / n**0.5
    q = Q.stochastic_round(torch.tensor([-100.0, 100.0, 6.5]), torch.tensor([0.0, 0.0, 0.0]), 4)
    assert q.tolist() == [-7, 7, 7]
