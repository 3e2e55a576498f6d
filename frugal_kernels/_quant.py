"""The INT-n weight format of DQT and its random numbers: the one home of each.

A quantized weight ``W [R, C]`` is stored as integer codes ``q`` with a float
scale ``s``, ``W = s * q``, and nothing else: no float copy of ``W`` exists.
Every layer (the C++, CUDA and Triton kernels, the reference, ``nn.QuantLinear``
and the optimizer) reads and writes this format, so it is defined here once;
csrc/include/frugal/quant.h mirrors it bit for bit. Like ``_layout``, this module
sits below ``ops`` and ``kernels`` and imports neither.

Codes. ``bits`` is one of ``QUANT_BITS``; the codes are the symmetric integers
``-qmax .. qmax`` with ``qmax = 2**(bits - 1) - 1`` (bits=2 is ternary,
{-1, 0, 1}, log2(3) = 1.58 bits of information in a 2-bit field; bits=8 gives
-127 .. 127, keeping the range symmetric so that ``-q`` is always a code).

Packing. Each row is packed on its own into ``packed_cols(C, bits)`` bytes
(``ceil(C * bits / 8)``), as a little-endian bit stream: the field of column
``c`` holds ``q + qmax`` (so ``0 .. 2 * qmax``, an unsigned field) in bits
``[c * bits, (c + 1) * bits)`` of the row, bit ``b`` of the row being bit
``b % 8`` of byte ``b // 8``. For bits=3 a field may straddle two bytes. The
padding bits at the end of a row are zero. The storage dtype is ``torch.uint8``
with shape ``[R, packed_cols(C, bits)]``: at most ``bits / 8`` bytes per weight
plus under one byte per row.

Scales. fp32, shape ``[1]`` (one per tensor) or ``[R]`` (one per row), read as
``s[0]`` or ``s[r]``. ``W[r, c] = s * q[r, c]`` is computed in fp32.

Stochastic rounding. A value ``w`` goes back to a code as
``x = w / s`` (an fp32 division), ``f = floor(x)``, ``q = f + (u < x - f)``,
clamped to ``[-qmax, qmax]`` (a NaN ``x`` gives 0), with ``u`` uniform in ``[0, 1)``: unbiased,
``E[s * q] = w`` while ``w`` lies inside the range. ``u`` comes from a
counter-based generator: a pure function of ``(seed, step, index)`` with
``index = r * C + c`` the element's place in the unpacked ``[R, C]`` weight, so
every backend, any launch grid, any thread count and a resumed run draw the
same numbers::

    mix32(x):  x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
    key      = mix32(step + mix32(seed + 0x9E3779B9))      (per tensor and step)
    u        = (mix32(index + key) >> 8) * 2**-24         (per element)

all in uint32 arithmetic that wraps. ``mix32`` is the "lowbias32" integer hash
(constants from Chris Wellons' hash-prospector, 2018); the golden-ratio
constant keeps seed 0 away from the fixed point ``mix32(0) = 0``. ``seed`` and
``step`` are taken modulo 2**32; ``index`` must be below 2**32 (weights of at
most 4Gi elements).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

QUANT_BITS = (2, 3, 4, 8)
GOLDEN = 0x9E3779B9
_MASK = 0xFFFFFFFF
_MIX_1, _MIX_2 = 0x7FEB352D, 0x846CA68B
_MIX_1_INVERSE, _MIX_2_INVERSE = (pow(m, -1, 1 << 32) for m in (_MIX_1, _MIX_2))


def qmax(bits: int) -> int:
    """The largest code of ``bits``: codes are ``-qmax .. qmax``."""
    return (1 << (bits - 1)) - 1


def packed_cols(cols: int, bits: int) -> int:
    """Bytes of one packed row of ``cols`` codes."""
    return (cols * bits + 7) // 8


def packed_shape(shape: Tuple[int, int], bits: int) -> Tuple[int, int]:
    """Shape of the uint8 codes of a weight of ``shape`` ``[R, C]``."""
    rows, cols = shape
    return rows, packed_cols(cols, bits)


def check_bits(bits: int, where: str) -> None:
    if bits not in QUANT_BITS:
        raise ValueError(f"{where}: bits must be one of {', '.join(map(str, QUANT_BITS))}; "
                         f"got {bits!r}")


# How a float weight sets the scale: DQT's mean of |W|, or the max of |W| (nothing clipped).
SCALE_INITS = ("absmean", "absmax")


def check_scale_init(scale_init: str, where: str) -> None:
    if scale_init not in SCALE_INITS:
        raise ValueError(f"{where}: scale_init must be one of {', '.join(map(repr, SCALE_INITS))}; "
                         f"got {scale_init!r}")


# ---------------------------------------------------------------- packing

def pack(q: Tensor, bits: int) -> Tensor:
    """Integer codes ``q [R, C]`` (any integer dtype, values in ``-qmax .. qmax``) to
    the packed uint8 ``[R, packed_cols(C, bits)]``."""
    rows, cols = q.shape
    fields = (q.to(torch.int64) + qmax(bits)).reshape(rows, cols, 1)
    # The bits of every field as 0/1, in stream order, then eight at a time into bytes.
    weights = torch.arange(bits, device=q.device)
    stream = ((fields >> weights) & 1).reshape(rows, cols * bits)
    pad = packed_cols(cols, bits) * 8 - cols * bits
    stream = torch.nn.functional.pad(stream, (0, pad))
    by_byte = stream.reshape(rows, packed_cols(cols, bits), 8) << torch.arange(8, device=q.device)
    return by_byte.sum(-1).to(torch.uint8)


def unpack(packed: Tensor, bits: int, cols: int) -> Tensor:
    """Packed uint8 codes ``[R, packed_cols(cols, bits)]`` back to int32 codes ``[R, cols]``."""
    rows = packed.shape[0]
    stream = (packed.to(torch.int64).unsqueeze(-1) >> torch.arange(8, device=packed.device)) & 1
    stream = stream.reshape(rows, packed.shape[1] * 8)[:, : cols * bits].reshape(rows, cols, bits)
    fields = (stream << torch.arange(bits, device=packed.device)).sum(-1)
    return (fields - qmax(bits)).to(torch.int32)


def are_codes(packed: Tensor, bits: int, cols: int) -> bool:
    """Whether uint8 ``packed [R, packed_cols(cols, bits)]`` holds codes of ``bits``:
    no field is all ones (the field ``2 * qmax + 1``, the one value of a width that is no
    code) and the padding bits are zero. Read in groups of bytes that hold whole fields
    (one byte at 2, 4 and 8 bits, three at 3 bits), a field's bits ANDed into its lowest:
    a few elementwise passes over the bytes, never unpacked (16M 4-bit weights: 0.18 s
    on a busy 2-core CPU, against 12 s through unpack)."""
    rows, width = packed.shape
    if packed.numel() == 0:
        return True
    group = 3 if bits == 3 else 1
    lowest = sum(1 << (bits * k) for k in range(8 * group // bits))
    rows_per_block = max(1, (1 << 24) // width)
    for start in range(0, rows, rows_per_block):
        v = packed[start:start + rows_per_block]
        if group == 3:
            v = torch.nn.functional.pad(v, (0, -width % 3)).reshape(v.shape[0], -1, 3)
            v = v.to(torch.int32)
            v = v[..., 0] | (v[..., 1] << 8) | (v[..., 2] << 16)
        ones = v
        for shift in range(1, bits):
            ones = ones & (v >> shift)
        if bool((ones & lowest).any()):
            return False
    pad = width * 8 - cols * bits
    return pad == 0 or not bool((packed[:, -1] >> (8 - pad)).any())


def dequantize(packed: Tensor, scale: Tensor, bits: int, cols: int) -> Tensor:
    """The fp32 weight ``s * q`` of packed codes (``scale`` of shape [1] or [R])."""
    q = unpack(packed, bits, cols).to(torch.float32)
    return q * scale.to(torch.float32).reshape(-1, 1)


# ---------------------------------------------------------------- random numbers

def mix32(x: Tensor) -> Tensor:
    """The lowbias32 hash of uint32 values held in an int64 tensor (results in
    ``[0, 2**32)``; products wrap as in uint32 arithmetic once masked)."""
    x = x & _MASK
    x = x ^ (x >> 16)
    x = (x * _MIX_1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _MIX_2) & _MASK
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x &= _MASK
    x ^= x >> 16
    x = (x * _MIX_1) & _MASK
    x ^= x >> 15
    x = (x * _MIX_2) & _MASK
    return x ^ (x >> 16)


def rng_key(seed: int, step: int) -> int:
    """The per-tensor, per-step key of the counter-based generator (a uint32)."""
    return _mix32_int(step + _mix32_int(seed + GOLDEN))


def _unmix32_int(x: int) -> int:
    """The inverse of ``_mix32_int`` (each step of lowbias32 is a bijection of uint32:
    an xor-shift undone by xoring the shifts back in, an odd multiplier by its
    inverse modulo 2**32)."""
    x &= _MASK
    x ^= x >> 16
    x = (x * _MIX_2_INVERSE) & _MASK
    x ^= (x >> 15) ^ (x >> 30)
    x = (x * _MIX_1_INVERSE) & _MASK
    return x ^ (x >> 16)


def shifted_seed(seed: int, step: int, offset: int) -> int:
    """The seed whose uniforms at ``step`` for the indices ``i`` are ``seed``'s for
    ``i + offset``: ``uniform(shifted_seed(s, t, o), t, i) == uniform(s, t, i + o)``.

    A block of rows of a weight that starts at element ``offset`` of the whole
    (a rank's rows under row sharding) rounds as the whole weight would when its
    own elements, counted from 0, are keyed by this seed: the element index only
    enters the key as ``index + key`` (mod 2**32), so shifting the index is
    shifting the key, and the key is reached from a seed by inverting ``mix32``
    twice. It depends on the step: a new one is made for every step."""
    target = (rng_key(seed, step) + offset) & _MASK
    return (_unmix32_int((_unmix32_int(target) - step) & _MASK) - GOLDEN) & _MASK


def uniform(seed: int, step: int, index: Tensor) -> Tensor:
    """fp32 uniforms in ``[0, 1)`` for the elements ``index`` (int64, < 2**32)."""
    bits24 = mix32(index.to(torch.int64) + rng_key(seed, step)) >> 8
    return bits24.to(torch.float32) * (1.0 / (1 << 24))


def stochastic_round(x: Tensor, u: Tensor, bits: int) -> Tensor:
    """``x`` (fp32, in units of the scale) to int32 codes: up with probability
    ``x - floor(x)``, given the uniforms ``u``; clamped to the code range. A NaN
    goes to the code 0 (``+-inf`` clamp to ``+-qmax``)."""
    f = torch.floor(x)
    q = f + (u < x - f).to(torch.float32)
    q = q.clamp_(-qmax(bits), qmax(bits)).nan_to_num_(nan=0.0)
    return q.to(torch.int32)
